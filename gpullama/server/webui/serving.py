"""Serving the chat page: ``GET /`` gives a browser (a request that accepts ``text/html``) the page and every other
client the probe answer it expects (Ollama's clients check for ``Ollama is running``); ``GET /assets/NAME`` gives
the page's files under content-hashed names.

The files are read once, on first use, from ``static/``: each JavaScript module's relative imports are rewritten to
the hashed names of what they import (so a file's name changes whenever it or anything it imports changes), each
file is gzip-compressed once, and the page's ``assets/...`` links point at the hashed names. The hashed files are
cached by the browser for a year (``immutable``); the page itself is revalidated on every load. Every answer
carries a Content-Security-Policy that allows scripts, styles and connections to this server alone, and no inline
script.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import html
import posixpath
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..state import server_state

STATIC = Path(__file__).resolve().with_name("static")
MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
"""The files served from ``static/`` by suffix (the licenses and notes beside the vendored files are not)."""

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "font-src 'self'; manifest-src 'self'; base-uri 'self'; form-action 'none'; frame-ancestors 'none'"
)
"""Scripts, styles, fetches only from this server (no inline script or style, no eval); images also from data:
and blob: URLs (an attached image's preview); the page cannot be framed."""
_SECURITY_HEADERS = {"content-security-policy": CONTENT_SECURITY_POLICY, "x-content-type-options": "nosniff",
                     "referrer-policy": "no-referrer", "cross-origin-opener-policy": "same-origin"}
IMMUTABLE = "public, max-age=31536000, immutable"
_IMPORT = re.compile(r"""(\bfrom\s*|\bimport\s*\(?\s*)(["'])(\.{1,2}/[^"']+)\2""")
"""A relative module specifier in an ``import``/``export ... from`` statement or a dynamic ``import()``."""
_LINK = re.compile(r"""\b(src|href)="assets/([^"]+)\"""")


@dataclass(frozen=True)
class Asset:
    """One served file: its media type, its bytes and their gzip compression."""

    media_type: str
    body: bytes
    gzipped: bytes


@dataclass(frozen=True)
class Bundle:
    """The page's files by hashed path (``app.3f9c2a1b7d0e.js``, ``vendor/marked.esm.0a1b2c3d4e5f.js``) and the
    page (``index.html`` with its links to them)."""

    assets: dict[str, Asset]
    page: str

    @classmethod
    def load(cls, folder: Path = STATIC) -> Bundle:
        """Read, rewrite, hash and compress every file under `folder`."""
        sources = {path.relative_to(folder).as_posix(): path for path in sorted(folder.rglob("*"))
                   if path.suffix in MEDIA_TYPES}
        hashed: dict[str, str] = {}  # source path -> hashed path
        assets: dict[str, Asset] = {}

        def add(name: str, chain: tuple[str, ...] = ()) -> str:
            if name in hashed:
                return hashed[name]
            if name not in sources:
                raise FileNotFoundError(f"webui: {chain[-1] if chain else 'index.html'} imports missing {name}")
            if name in chain:
                raise ValueError(f"webui: import cycle {' -> '.join((*chain, name))}")
            body = sources[name].read_bytes()
            if name.endswith(".js"):
                def rewrite(match: re.Match) -> str:
                    target = posixpath.normpath(posixpath.join(posixpath.dirname(name), match[3]))
                    relative = posixpath.relpath(add(target, (*chain, name)), posixpath.dirname(name) or ".")
                    return f"{match[1]}{match[2]}./{relative}{match[2]}"

                body = _IMPORT.sub(rewrite, body.decode()).encode()
            stem, dot, suffix = name.rpartition(".")
            hashed[name] = f"{stem}.{hashlib.sha256(body).hexdigest()[:12]}{dot}{suffix}"
            assets[hashed[name]] = Asset(MEDIA_TYPES["." + suffix], body, gzip.compress(body, 9, mtime=0))
            return hashed[name]

        for name in sources:
            add(name)
        page = _LINK.sub(lambda m: f'{m[1]}="assets/{add(m[2])}"', (folder / "index.html").read_text())
        return cls(assets, page)


@functools.cache
def bundle() -> Bundle:
    """The page's files, read once."""
    return Bundle.load()


def _encoded(request: Request, body: bytes, gzipped: bytes, media_type: str, headers: dict[str, str]) -> Response:
    """`body` gzip-compressed when the client accepts it (and it is smaller)."""
    headers = {**headers, "vary": "accept-encoding"}
    if "gzip" in request.headers.get("accept-encoding", "") and len(gzipped) < len(body):
        body, headers["content-encoding"] = gzipped, "gzip"
    return Response(body, media_type=media_type, headers=headers)


def wants_html(request: Request) -> bool:
    """Whether the client asked for a web page (browsers send ``Accept: text/html,...``; API clients do not)."""
    return "text/html" in request.headers.get("accept", "").lower()


def root(probe: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The ``GET /`` endpoint: the page for a browser, `probe` for any other client; with ``--no-webui`` a browser
    is told where the API is."""

    async def endpoint(request: Request) -> Response:
        if not wants_html(request):
            return await probe(request)
        prefix = request.scope.get("root_path", "")
        if not server_state(request).config.webui:
            return PlainTextResponse(
                f"gpullama-serve is running; its web UI is off (--no-webui).\n"
                f"The OpenAI-compatible API is at {prefix}/v1 (POST {prefix}/v1/chat/completions, "
                f"GET {prefix}/v1/models); docs/server.md lists every endpoint.\n",
                headers={"x-content-type-options": "nosniff"})
        page = bundle().page
        if prefix:  # behind a proxy under a path prefix: the page's relative links resolve below it
            page = page.replace("<head>", f'<head>\n<base href="{html.escape(prefix, quote=True)}/">', 1)
        body = page.encode()
        return _encoded(request, body, gzip.compress(body, 6, mtime=0), "text/html; charset=utf-8",
                        {**_SECURITY_HEADERS, "cache-control": "no-cache"})

    return endpoint


async def asset(request: Request) -> Response:
    """``GET /assets/{name}``: one of the page's files by its hashed name; 404 for any other name, and with
    ``--no-webui``."""
    found = bundle().assets.get(request.path_params["name"]) if server_state(request).config.webui else None
    if found is None:
        raise HTTPException(404)
    return _encoded(request, found.body, found.gzipped, found.media_type,
                    {**_SECURITY_HEADERS, "cache-control": IMMUTABLE})
