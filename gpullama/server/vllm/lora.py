"""vLLM's runtime adapter routes, served only with ``--enable-lora-runtime-updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` loads a GGUF
LoRA adapter under that name (then usable as a request's `model`, and listed by GET /lora-adapters at global scale
0), ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` unloads it (409 while a request uses it)."""

from __future__ import annotations

import asyncio
import os

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..adapters import ServedAdapter
from ..http.errors import APIError
from ..http.fields import object_body, str_field
from ..pipeline.intake import read_json
from ..state import require_ready, server_state


def _enabled(state) -> None:
    if not state.config.lora_runtime_updating:
        raise APIError(404, "loading LoRA adapters at run time is off; start the server with "
                       "--enable-lora-runtime-updating", code="not_found")


async def load_adapter(request: Request) -> Response:
    """``POST /v1/load_lora_adapter``."""
    state = server_state(request)
    _enabled(state)
    require_ready(state)
    body = object_body(await read_json(request))
    name, path = str_field(body, "lora_name"), str_field(body, "lora_path")
    if not name or not path:
        raise APIError(400, "both 'lora_name' and 'lora_path' must be given", param="lora_name" if not name else
                       "lora_path")
    if name in state.llm.loras or name == state.model_name:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    if not os.path.isfile(path):
        raise APIError(400, f"LoRA adapter file {path!r} does not exist", param="lora_path")
    try:
        adapter_id = await asyncio.to_thread(state.llm.load_lora, path, name)
    except ValueError as exc:  # not an adapter, or not one of this model (architecture, shapes)
        raise APIError(400, str(exc), param="lora_path") from None
    state.set_adapters([*state.adapters, ServedAdapter(adapter_id, name, path, 0.0, 1.0)])
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_adapter(request: Request) -> Response:
    """``POST /v1/unload_lora_adapter``."""
    state = server_state(request)
    _enabled(state)
    require_ready(state)
    body = object_body(await read_json(request))
    name = str_field(body, "lora_name")
    if not name or name not in state.llm.loras:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
    try:
        state.llm.unload_lora(name)
    except ValueError as exc:  # in use by a queued or running request
        raise APIError(409, str(exc), param="lora_name") from None
    state.set_adapters([a for a in state.adapters if a.name != name])
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


