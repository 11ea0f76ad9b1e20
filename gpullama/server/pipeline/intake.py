"""How every endpoint starts: its body read under the server's configured size and time limits, 503 until the model
is loaded, and the endpoint's parse run off the event loop when the body is large."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request

from ..http.body import off_loop_if_large, parse_json, read_body
from ..state import ServerState, require_ready, server_state


async def read_request_body(request: Request) -> bytes:
    """`read_body` with the server's configured size and time limits."""
    config = server_state(request).config
    return await read_body(request, config.max_body_bytes, config.body_timeout)


async def read_json(request: Request) -> Any:
    """The request body parsed as JSON (off the event loop when large); see `read_body` for the refusals."""
    raw = await read_request_body(request)
    return await off_loop_if_large(len(raw), parse_json, raw)


async def read_and_prepare(request: Request, prepare, *args) -> tuple[float, ServerState, Any]:
    """How every generating endpoint starts: (its arrival time, the server state, ``prepare(*args, state, raw)`` for
    the body read under the limits, run off the event loop when the body is large); 503 until the model is loaded."""
    arrival = time.perf_counter()
    state = server_state(request)
    require_ready(state)
    raw = await read_request_body(request)
    # a model that reads images may encode some while preparing: never on the event loop
    size = len(raw) if getattr(state.llm, "vision", None) is None else 1 << 62
    return arrival, state, await off_loop_if_large(size, prepare, *args, state, raw)
