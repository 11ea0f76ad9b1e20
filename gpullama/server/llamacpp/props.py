"""``GET /props`` and ``POST /apply-template``: llama.cpp's server properties (the fields its clients read: the
chat template, the context size, the model path, the default generation settings, build info) and its chat
template rendering without generation."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gpullama.chat.model_format import chat_format

from ..http.body import JSONResponse, off_loop_if_long
from ..http.fields import object_body
from ..openai.chat import parse_messages
from ..pipeline.chat_plan import plan_chat, render_chat
from ..pipeline.intake import read_json_for_model
from ..registry import use_model
from ..state import BUILD_INFO, ChatDefaults, check_model, require_ready, server_state
from .request import sampling


async def props(request: Request) -> Response:
    """``GET /props``: read-only (llama.cpp's ``POST /props`` needs ``--props``; it is not served)."""
    require_ready(server_state(request))
    state = await use_model(request, request.query_params.get("model"))  # llama.cpp's router: ?model=NAME
    llm, engine_args = state.llm, state.config.engine
    tok = llm.tokenizer
    _, settings = sampling({}, tok, state.config.defaults)
    return JSONResponse({
        "default_generation_settings": {"params": {**settings, "stream": False, "n_probs": 0, "grammar": "",
                                                   "max_tokens": settings["n_predict"]},
                                        "n_ctx": llm.max_model_len},
        "total_slots": engine_args.max_num_seqs,
        "model_alias": state.model_name,
        "model_path": str(engine_args.model),
        "modalities": {"vision": getattr(llm, "vision", None) is not None, "video": False, "audio": False},
        "endpoint_slots": False, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": tok.chat_template.source,
        "chat_template_caps": {},
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "build_info": BUILD_INFO,
        "is_sleeping": False,
    })


def _render(tok: Any, defaults: ChatDefaults, body: dict) -> str:
    messages = parse_messages(body)
    fields = {**body, "tools": body.get("tools") or None}  # llama.cpp takes an empty list as none
    return render_chat(tok, plan_chat(fields, messages, chat_format(tok), defaults))


async def apply_template(request: Request) -> Response:
    """``POST /apply-template``: a chat completions body's messages (and tools, chat_template_kwargs,
    add_generation_prompt, continue_final_message) rendered with the chat template -> ``{"prompt": text}``."""
    state, body = await read_json_for_model(request)
    body = object_body(body)
    check_model(state, body.get("model"))
    tok = state.llm.tokenizer
    size = len(orjson.dumps(body))
    return JSONResponse({"prompt": await off_loop_if_long(size, _render, tok, state.config.chat, body)})
