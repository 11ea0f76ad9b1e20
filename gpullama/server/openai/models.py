"""``GET /v1/models`` and ``GET /v1/models/{model}``: the one served model in OpenAI's shapes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..http.body import JSONResponse
from ..state import ServerState, check_model, require_ready, server_state


def model_card(state: ServerState) -> dict:
    """The served model as an OpenAI model object (with vLLM's ``max_model_len``)."""
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "gpullama",
            "max_model_len": state.llm.max_model_len}


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the one served model in OpenAI's list shape."""
    state = server_state(request)
    require_ready(state)
    base = model_card(state)
    # LoRA adapters as models of their own (vLLM lists its --lora-modules so), their base as `parent`
    adapters = [{**base, "id": a.name, "root": a.path, "parent": state.model_name} for a in state.adapters]
    return JSONResponse({"object": "list", "data": [base, *adapters]})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model}``: the served model's card, 404 for any other name."""
    state = server_state(request)
    require_ready(state)
    name = request.path_params["model"]
    check_model(state, name)
    card = model_card(state)
    adapter = next((a for a in state.adapters if a.name == name and name != state.model_name), None)
    return JSONResponse(card if adapter is None else {**card, "id": name, "root": adapter.path,
                                                      "parent": state.model_name})
