"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, in vLLM's request and response shapes, and
llama.cpp's (``content``, ``add_special``, ``parse_special``, ``with_pieces``; ``content`` in the answer)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gpullama import __version__
from gpullama.chat.model_format import chat_format

from ..http.body import JSONResponse, off_loop_if_long
from ..http.errors import APIError
from ..http.fields import bool_field, object_body, str_field
from ..openai.chat import parse_messages
from ..pipeline.chat_plan import plan_chat, render_chat
from ..pipeline.intake import read_json_for_model
from ..state import check_model


def _object(body: Any) -> dict:
    body = object_body(body)
    str_field(body, "model")
    return body


def _piece(tokenizer: Any, token_id: int) -> str | list[int]:
    """llama.cpp's piece of a token: its text, or its bytes when they are not valid UTF-8 alone."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _tokenize_content(tok: Any, body: dict, max_model_len: int) -> dict:
    """llama.cpp's ``/tokenize``: `content` (text, or text and token ids mixed), `add_special` (BOS, default
    false), `parse_special` (default true), `with_pieces` (each token as ``{"id", "piece"}``)."""
    content = body["content"]
    pieces = [content] if isinstance(content, str) else content
    if not isinstance(pieces, list) or not all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool))
                                               for p in pieces):
        raise APIError(400, "'content' must be a string or a list of strings and token ids", param="content")
    add_special, parse_special = bool_field(body, "add_special", False), bool_field(body, "parse_special", True)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, int):
            ids.append(piece)
            continue
        part = tok.encode(piece) if parse_special else tok.encode_plain(piece)
        if add_special and i == 0 and tok.add_bos_token:
            part = [tok.bos_token_id, *part]
        ids += part
    outside = [t for t in ids if not 0 <= t < tok.vocab_size]
    if outside:
        raise APIError(400, f"token id {outside[0]} is out of range: the vocabulary has {tok.vocab_size} tokens",
                       param="content")
    tokens: list = [{"id": t, "piece": _piece(tok, t)} for t in ids] if bool_field(body, "with_pieces", False) else ids
    return {"tokens": tokens, "count": len(ids), "max_model_len": max_model_len}


async def tokenize(request: Request) -> Response:
    """``POST /tokenize``: a `prompt`, or `messages` rendered with the chat template (with `tools`, `tool_choice`
    and `chat_template_kwargs` as chat completions renders them, so the count is the real prompt's), as token ids.

    Answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (token strings only with `return_token_strs`).
    llama.cpp's `content` instead: answers ``{"tokens", "count", "max_model_len"}`` (see `_tokenize_content`)."""
    state, body = await read_json_for_model(request)
    body = _object(body)
    check_model(state, body.get("model"))
    tok = state.llm.tokenizer
    if sum(name in body for name in ("prompt", "messages", "content")) != 1:
        raise APIError(400, "give one of 'prompt' (a string), 'content' (llama.cpp's: a string) or 'messages' "
                       "(a list of messages)", param="prompt")
    if "content" in body:
        size = len(body["content"]) if isinstance(body["content"], (str, list)) else 0
        return JSONResponse(await off_loop_if_long(size, _tokenize_content, tok, body, state.llm.max_model_len))
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise APIError(400, f"'prompt' must be a string, got {type(prompt).__name__}", param="prompt")
        add_special = bool_field(body, "add_special_tokens", True)
        ids = await off_loop_if_long(len(prompt), tok.encode, prompt, add_special_tokens=add_special)
    else:
        messages = parse_messages(body)
        if bool_field(body, "continue_final_message") and bool_field(body, "add_generation_prompt", True):
            # vLLM's rule here: add_generation_prompt defaults to true, so asking to continue alone is a conflict
            raise APIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                           param="continue_final_message")
        size = sum(len(m["content"]) for m in messages) + len(orjson.dumps(body.get("tools")))
        # tools, template kwargs and rendering flags, as the chat endpoint has them
        plan = plan_chat(body, messages, chat_format(tok), state.config.chat)
        text = await off_loop_if_long(size, render_chat, tok, plan)
        ids = await off_loop_if_long(size, tok.encode, text, add_special_tokens=bool_field(body, "add_special_tokens", False))
    strs = tok.convert_ids_to_tokens(ids) if bool_field(body, "return_token_strs", False) else None
    return JSONResponse({"count": len(ids), "max_model_len": state.llm.max_model_len, "tokens": ids,
                         "token_strs": strs})


async def detokenize(request: Request) -> Response:
    """``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text, "content": text}`` (vLLM's name and
    llama.cpp's; special tokens kept, as both do)."""
    state, body = await read_json_for_model(request)
    body = _object(body)
    check_model(state, body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, "'tokens' must be a list of token ids (integers)", param="tokens")
    vocab = state.llm.tokenizer.vocab_size
    outside = [t for t in tokens if not 0 <= t < vocab]
    if outside:
        raise APIError(400, f"token id {outside[0]} is out of range: the vocabulary has {vocab} tokens",
                       param="tokens")
    text = await off_loop_if_long(len(tokens), state.llm.tokenizer.decode, tokens)
    return JSONResponse({"prompt": text, "content": text})


async def version(request: Request) -> Response:
    """``GET /version``: ``{"version": "X.Y.Z"}`` of gpullama."""
    return JSONResponse({"version": __version__})
