"""Serving below a path prefix (``--root-path``), behind a reverse proxy that forwards ``/PREFIX/...`` here."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


def normalize_root_path(text: str) -> str:
    """``--root-path``'s value as a prefix: one leading slash, no trailing one (``""`` for none)."""
    text = text.strip().strip("/")
    return f"/{text}" if text else ""


class RootPathMiddleware:
    """Outermost: a request path under the prefix has the prefix removed (a proxy that forwards the path as it came)
    and one outside it is taken as it is (a proxy that strips the prefix), so every route, the API-key check and the
    error shapes see the same path either way; ``scope["root_path"]`` holds the prefix, from which the chat page
    builds its links. (uvicorn's own ``root_path`` would put the prefix back in front of every path, and the
    middleware here match paths as they come.)"""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = normalize_root_path(root_path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.root_path:
            return await self.app(scope, receive, send)
        path, prefix = scope["path"], self.root_path
        scope = {**scope, "root_path": prefix}
        if path == prefix or path.startswith(prefix + "/"):
            scope["path"] = path[len(prefix):] or "/"
            raw = scope.get("raw_path")
            if raw is not None and raw.startswith(prefix.encode()):
                scope["raw_path"] = raw[len(prefix):] or b"/"
        await self.app(scope, receive, send)
