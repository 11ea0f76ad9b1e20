"""What every route handler uses: the orjson response, the JSON body reader with its size limit, the readiness
and model checks, and tokenizing long inputs off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .errors import APIError
from .state import ServerState

THREAD_TOKENIZE_CHARS = 8192  # longer inputs are tokenized off the event loop


class JSONResponse(Response):
    """A JSON response serialised with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def server_state(request: Request) -> ServerState:
    """The server's shared state."""
    return request.app.state.server


async def read_json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON; 413 past ``limit`` bytes, 400 when malformed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes, over the limit of {limit} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object", code="invalid_json")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON in the request body: {exc}", code="invalid_json") from exc


def require_ready(state: ServerState) -> None:
    """503 while the model loads, when it failed to, or when the engine has stopped."""
    if state.status == "loading":
        raise APIError(503, "the model is still loading; retry when GET /health answers 200", code="model_loading")
    if state.status != "ready" or state.engine is None:
        raise APIError(503, f"the model is not available ({state.status}: {state.error})", code="model_unavailable")
    if not getattr(state.engine, "is_alive", True):
        raise APIError(503, "the generation engine has stopped; restart the server", code="engine_dead")


def check_model(state: ServerState, model: str | None) -> None:
    """404 unless `model` is absent or the served model's name."""
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
                       param="model", code="model_not_found")


async def off_loop_if_long(size: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, in a worker thread when the input is longer than `THREAD_TOKENIZE_CHARS`."""
    if size > THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)
