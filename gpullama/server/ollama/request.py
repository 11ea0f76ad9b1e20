"""Ollama's request fields: `options` (temperature, top_p, top_k, min_p, num_predict, stop, seed, repeat_penalty,
presence and frequency penalties, num_ctx as a check), `format` (``"json"`` or a JSON schema, for the grammar
engine), `think`, the model name, and chat messages (``tool_calls`` with object arguments, ``tool`` messages with
``tool_name``) put in chat completions' shape."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from gpullama.chat.messages import MAX_MESSAGES

from ..http.errors import APIError, FieldNames
from ..http.fields import bad, kind
from ..pipeline.sampling import SamplingOptions, stop_strings
from ..state import ServerState

NAMES = FieldNames(
    fields=(("max_tokens", "options.num_predict"), ("stop", "options.stop"), ("temperature", "options.temperature"),
            ("top_p", "options.top_p"), ("top_k", "options.top_k"), ("min_p", "options.min_p"),
            ("seed", "options.seed"), ("repetition_penalty", "options.repeat_penalty"),
            ("presence_penalty", "options.presence_penalty"), ("frequency_penalty", "options.frequency_penalty"),
            ("response_format", "format"), ("chat_template_kwargs", "think"), ("prompt", "messages")),
    paths=((r"\bresponse_format(\.json_schema)?(\.schema)?\b", "format"),))
"""Ollama's names for chat's fields (chat; /api/generate's prompt is `prompt`)."""
GENERATE_NAMES = NAMES.but(prompt="prompt")
# option -> (SamplingParams field, type)
_OPTIONS = {"temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
            "min_p": ("min_p", float), "seed": ("seed", int), "repeat_penalty": ("repetition_penalty", float),
            "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float)}
ROLES = ("system", "user", "assistant", "tool")


def now_iso() -> str:
    """Ollama's ``created_at``: the current UTC time, ISO 8601 with a Z."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def check_model_name(state: ServerState, name: Any) -> None:
    """404 unless `name` is absent, the served model's name, or that name with Ollama's ``:latest`` tag."""
    if name is None or name == "":
        return
    if not isinstance(name, str):
        raise bad("model", "'model' must be a string")
    if name not in (state.model_name, f"{state.model_name}:latest"):
        raise APIError(404, f"model '{name}' not found; this server serves '{state.model_name}'", param="model",
                       code="model_not_found")


def options(body: dict, max_model_len: int) -> SamplingOptions:
    """The sampling options of `options`; unknown options (num_gpu, num_thread, mirostat, ...) are ignored, as
    Ollama ignores what a runner does not use."""
    opts = SamplingOptions()
    value = body.get("options")
    if value is None:
        return opts
    if not isinstance(value, dict):
        raise bad("options", f"'options' must be an object, got {kind(value)}")
    for name, (field, cast) in _OPTIONS.items():
        v = value.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (cast is int and not isinstance(v, int)):
            raise bad(f"options.{name}", f"'options.{name}' must be {'an integer' if cast is int else 'a number'}, "
                      f"got {kind(v)} {v!r}")
        opts.kwargs[field] = v
    predict = value.get("num_predict")
    if predict is not None:
        if isinstance(predict, bool) or not isinstance(predict, int) or predict == 0 or predict < -2:
            raise bad("options.num_predict", f"'options.num_predict' must be a positive integer, or -1 or -2 (until "
                      f"the context is full), got {predict!r}")
        opts.max_tokens = predict if predict > 0 else None
    num_ctx = value.get("num_ctx")
    if num_ctx is not None:
        if isinstance(num_ctx, bool) or not isinstance(num_ctx, int) or num_ctx < 1:
            raise bad("options.num_ctx", f"'options.num_ctx' must be a positive integer, got {num_ctx!r}")
        if num_ctx > max_model_len:
            raise bad("options.num_ctx", f"'options.num_ctx' is {num_ctx}, more than this server's context of "
                      f"{max_model_len} tokens (gpullama-serve --max-model-len)")
    stop = stop_strings({"stop": value.get("stop")})
    if stop:
        opts.kwargs["stop"] = stop
    return opts


def response_format(body: dict) -> dict | None:
    """Chat's `response_format` of Ollama's `format`: ``"json"`` any JSON object, an object a JSON schema."""
    value = body.get("format")
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise bad("format", f"'format' must be \"json\" or a JSON schema object, got {str(value)[:40]!r}")


def think(body: dict) -> dict[str, Any] | None:
    """The template kwargs of `think` (true/false, or a level, which counts as true)."""
    value = body.get("think")
    if value is None:
        return None
    if not isinstance(value, (bool, str)):
        raise bad("think", f"'think' must be a boolean or 'low', 'medium', 'high', got {kind(value)}")
    return {"enable_thinking": bool(value)}


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """Ollama chat messages in chat completions' shape: assistant ``tool_calls`` with object arguments get ids and
    JSON strings, ``tool`` messages their ``tool_name`` as ``name``, ``thinking`` the ``reasoning_content``."""
    if not isinstance(value, list) or not value:
        raise bad("messages", f"'messages' must be a non-empty list of messages, got {kind(value)}")
    if len(value) > MAX_MESSAGES:
        raise bad("messages", f"'messages' holds {len(value)} messages; at most {MAX_MESSAGES} are allowed")
    out = []
    calls_seen = 0
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"'{where}' must be an object, got {kind(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"'{where}.role' must be one of {list(ROLES)}, got {str(role)[:40]!r}")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"'{where}.content' must be a string, got {kind(content)}")
        if message.get("images"):
            raise bad(f"{where}.images", f"'{where}.images': this server's models read text only")
        entry: dict[str, Any] = {"role": role, "content": content}
        if role == "tool" and isinstance(message.get("tool_name"), str):
            entry["name"] = message["tool_name"]
        if role == "assistant" and isinstance(message.get("thinking"), str) and message["thinking"]:
            entry["reasoning_content"] = message["thinking"]
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls", f"'{where}.tool_calls' must be a list, on an assistant message")
            entry["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}.tool_calls[{j}]", f"'{where}.tool_calls[{j}]' must be "
                              "{'function': {'name': ..., 'arguments': {...}}}")
                arguments = fn.get("arguments") or {}
                if not isinstance(arguments, (dict, str)):
                    raise bad(f"{where}.tool_calls[{j}].function.arguments",
                              f"'{where}.tool_calls[{j}].function.arguments' must be an object")
                text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
                entry["tool_calls"].append({"id": f"call_{calls_seen}", "type": "function",
                                            "function": {"name": fn["name"], "arguments": text}})
                calls_seen += 1
        out.append(entry)
    return out
