"""Request bodies and JSON answers: the orjson response, the JSON body reader with its type, size and time limits,
and moving long work off the event loop (the server's configured limits are applied in `pipeline.intake`)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response

from .errors import APIError

THREAD_TOKENIZE_CHARS = 8192  # longer inputs are tokenized off the event loop
# Bodies past this many bytes are parsed, validated, rendered and tokenized off the event loop: every one of those
# costs at least time linear in the body's bytes (130,000 empty messages are small text but 4 MB of JSON).
OFF_LOOP_BODY_BYTES = 8192
_JSON_TYPES = ("application/json",)
_CLOSE = {"connection": "close"}  # answered before the whole body was read: the connection cannot be reused


class JSONResponse(Response):
    """A JSON response serialised with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media in _JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The raw request body: 415 unless it is JSON, 413 past ``limit`` bytes, 408 when it does not arrive within
    ``timeout`` seconds, 400 when empty. Only ``application/json`` is accepted, so a web page cannot send a request
    without a CORS preflight (forms and ``text/plain`` need none); a body without a Content-Type is read first, so
    an empty one is still a 400 and an oversized one a 413."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json_type(content_type):
        raise APIError(415, f"the request body must be JSON with 'Content-Type: application/json', "
                       f"got {content_type[:100]!r}", code="unsupported_media_type", headers=_CLOSE)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes, over the limit of {limit} bytes",
                       code="request_too_large", headers=_CLOSE)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout or None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large",
                                   headers=_CLOSE)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} seconds (--body-timeout)",
                       code="request_timeout", headers=_CLOSE) from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object", code="invalid_json")
    if content_type is None:
        raise APIError(415, "the request body must be JSON with 'Content-Type: application/json', "
                       "got no Content-Type", code="unsupported_media_type")
    return raw


def parse_json(raw: bytes) -> Any:
    """The body parsed as JSON; 400 when malformed."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON in the request body: {exc}", code="invalid_json") from exc


async def off_loop_if_long(size: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, in a worker thread when the input is longer than `THREAD_TOKENIZE_CHARS`."""
    if size > THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def off_loop_if_large(body_bytes: int, fn, *args, **kwargs):
    """Run ``fn`` in a worker thread when the body it works through is large (by bytes, hence by any count)."""
    if body_bytes > OFF_LOOP_BODY_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)
