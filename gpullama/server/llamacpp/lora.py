"""llama.cpp's ``GET /lora-adapters`` (the loaded adapters: id, path, global scale) and ``POST /lora-adapters``
(set the global scales: ``[{"id": 0, "scale": 0.5}]``; an adapter left out goes to 0), which every request without
its own ``lora`` field then runs with."""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import Response

from ..http.body import JSONResponse
from ..http.errors import APIError
from ..pipeline.intake import read_json
from ..pipeline.sampling import Scope, lora
from ..state import require_ready, server_state


def adapter_list(state) -> list[dict]:
    """The adapters in llama.cpp's shape (and their names, which a request's `model` may give)."""
    return [{"id": a.id, "path": a.path, "scale": a.scale, "task_name": "", "prompt_prefix": "", "name": a.name}
            for a in state.adapters]


async def get_adapters(request: Request) -> Response:
    """``GET /lora-adapters``."""
    state = server_state(request)
    require_ready(state)
    return JSONResponse(adapter_list(state))


async def set_adapters(request: Request) -> Response:
    """``POST /lora-adapters``: a list of ``{"id", "scale"}`` sets every adapter's global scale (0 if left out);
    400 for an unknown id."""
    state = server_state(request)
    require_ready(state)
    body = await read_json(request)
    pairs = lora(body, "body", Scope({})) or []
    known = {a.id for a in state.adapters}
    unknown = next((i for i, _ in pairs if i not in known), None)
    if unknown is not None:
        raise APIError(400, f"LoRA adapter id {unknown} is not loaded (ids: {sorted(known)})", param="id")
    scales = dict(pairs)
    state.set_adapters([dataclasses.replace(a, scale=scales.get(a.id, 0.0)) for a in state.adapters])
    return JSONResponse({"success": True})
