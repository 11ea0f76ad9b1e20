"""``GET /v1/models`` and ``GET /v1/models/{model}``: the served models in OpenAI's shapes (also llama.cpp's
``GET /models``, with each model's ``status`` as its router mode gives it), and llama.cpp's ``POST /models/load`` and
``POST /models/unload``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..http.body import JSONResponse
from ..http.errors import APIError
from ..http.fields import object_body
from ..pipeline.intake import read_json
from ..registry import ModelState, lookup, unknown_model, use_model
from ..state import ServerState, check_model, require_ready, server_state


def model_status(entry: ModelState) -> dict[str, Any]:
    """llama.cpp's router ``status`` object: ``value`` loaded, loading or unloaded; a failed load is ``unloaded``
    with ``failed: true`` (and gpullama's ``error``, why)."""
    if entry.status == "failed":
        return {"value": "unloaded", "failed": True, "error": entry.error}
    return {"value": entry.status}


def model_card(state: ServerState | ModelState, listed: bool = False) -> dict:
    """A served model as an OpenAI model object (with vLLM's ``max_model_len`` while it is loaded); on a server
    of several models (`listed`) with its ``status``."""
    card: dict[str, Any] = {"id": state.model_name, "object": "model", "created": state.created,
                            "owned_by": "gpullama"}
    if state.llm is not None:
        card["max_model_len"] = state.llm.max_model_len
    if listed:
        card["status"] = model_status(state)
    return card


async def list_models(request: Request) -> Response:
    """``GET /v1/models`` (and ``GET /models``): every served model in OpenAI's list shape."""
    state = server_state(request)
    require_ready(state)
    data = []
    for entry in state.models.values():
        card = model_card(entry, state.multi)
        # LoRA adapters as models of their own (vLLM lists its --lora-modules so), their base as `parent`
        data += [card, *({**card, "id": a.name, "root": a.path, "parent": entry.model_name} for a in entry.adapters)]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model}``: a served model's card, 404 for any other name."""
    state = server_state(request)
    require_ready(state)
    name = request.path_params["model"]
    if not state.multi:
        check_model(state, name)
        entry = state.default
    else:
        entry = lookup(state, name)
        if entry is None:
            raise unknown_model(state, name, request.url.path)
    card = model_card(entry, state.multi)
    adapter = next((a for a in entry.adapters if a.name == name and name != entry.model_name), None)
    return JSONResponse(card if adapter is None else {**card, "id": name, "root": adapter.path,
                                                      "parent": entry.model_name})


async def _named(request: Request) -> tuple[ServerState, ModelState, str]:
    state = server_state(request)
    require_ready(state)
    body = object_body(await read_json(request))
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise APIError(400, "'model' is required: the name of a served model", param="model")
    entry = lookup(state, name)
    if entry is None:
        raise unknown_model(state, name, request.url.path)
    return state, entry, name


async def load_model(request: Request) -> Response:
    """``POST /models/load`` (llama.cpp's router): load a model now; answers ``{"success": true}`` once it is
    loaded, the load's error otherwise. It then stays for the server's keep-alive (``--keep-alive``)."""
    _, entry, name = await _named(request)
    await use_model(request, name)
    return JSONResponse({"success": True, "model": entry.name, "status": model_status(entry)})


async def unload_model(request: Request) -> Response:
    """``POST /models/unload`` (llama.cpp's router): unload a model now, or once the requests it is serving end."""
    _, entry, _ = await _named(request)
    entry.request_unload()
    if entry.active == 0:
        await entry.released()
    return JSONResponse({"success": True, "model": entry.name, "status": model_status(entry)})
