"""How every endpoint starts: its body read under the server's configured size and time limits, 503 until the model
is loaded, and the endpoint's parse run off the event loop when the body is large."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request

from ..http.body import off_loop_if_large, parse_json, read_body
from ..http.errors import APIError
from ..registry import ModelState, parse_keep_alive, use_model
from ..state import require_ready, server_state


async def read_request_body(request: Request) -> bytes:
    """`read_body` with the server's configured size and time limits."""
    config = server_state(request).config
    return await read_body(request, config.max_body_bytes, config.body_timeout)


async def read_json(request: Request) -> Any:
    """The request body parsed as JSON (off the event loop when large); see `read_body` for the refusals."""
    raw = await read_request_body(request)
    return await off_loop_if_large(len(raw), parse_json, raw)


async def read_and_prepare(request: Request, prepare, *args) -> tuple[float, ModelState, Any]:
    """How every generating endpoint starts: (its arrival time, the model the body's ``model`` names, loaded and
    held for the request, ``prepare(*args, model, raw)`` for the body read under the limits, run off the event loop
    when the body is large); 503 until the server is ready, 404 for a model it does not serve."""
    arrival, raw, name, keep_alive = await read_model_body(request)
    state = await use_model(request, name, keep_alive)
    return arrival, state, await off_loop_if_large(prepare_size(state, raw), prepare, *args, state, raw)


def prepare_size(state: ModelState, raw: bytes) -> int:
    """The size `off_loop_if_large` weighs a body's preparation by: a model that reads images may encode some
    while preparing, never on the event loop."""
    return len(raw) if getattr(state.llm, "vision", None) is None else 1 << 62


async def read_model_body(request: Request) -> tuple[float, bytes, Any, float | None]:
    """The first half of `read_and_prepare`: (arrival time, the raw body, the ``model`` it names, its
    ``keep_alive`` on Ollama's routes), 503 until the server is ready."""
    arrival = time.perf_counter()
    require_ready(server_state(request))
    raw = await read_request_body(request)
    name, keep_alive = await off_loop_if_large(len(raw), model_fields, raw, request.url.path)
    return arrival, raw, name, keep_alive


KEEP_ALIVE_PATHS = ("/api/generate", "/api/chat", "/api/embed", "/api/embeddings")
"""Ollama's routes, whose bodies may carry ``keep_alive``."""


def model_fields(raw: bytes, path: str) -> tuple[Any, float | None]:
    """The ``model`` a body names and, on Ollama's routes, its ``keep_alive`` in seconds; a body that is not a JSON
    object names none (its endpoint's own parse then says what is wrong with it)."""
    try:
        body = parse_json(raw)
    except APIError:
        return None, None
    if not isinstance(body, dict):
        return None, None
    return body.get("model"), request_keep_alive(body) if path in KEEP_ALIVE_PATHS else None


def request_keep_alive(body: dict) -> float | None:
    """A body's ``keep_alive`` in seconds (`FOREVER` for a negative one), None when it leaves it out; 400 when it
    is not a duration."""
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param="keep_alive") from None


async def read_json_for_model(request: Request) -> tuple[ModelState, Any]:
    """(the model the JSON body's ``model`` names, loaded and held for the request; the body): 503 until the server
    is ready, 404 for a model it does not serve (on a server of several)."""
    require_ready(server_state(request))
    body = await read_json(request)
    fields = body if isinstance(body, dict) else {}
    keep_alive = request_keep_alive(fields) if request.url.path in KEEP_ALIVE_PATHS else None
    return await use_model(request, fields.get("model"), keep_alive), body
