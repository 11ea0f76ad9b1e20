"""Ollama's request fields: `options` (temperature, top_p, top_k, min_p, num_predict, stop, seed, repeat_penalty,
presence and frequency penalties, num_ctx as a check), `format` (``"json"`` or a JSON schema, for the grammar
engine), `think`, the model name, and chat messages (``tool_calls`` with object arguments, ``tool`` messages with
``tool_name``) put in chat completions' shape."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from gpullama.chat.messages import message_items, role_of
from gpullama.vision.images import ImageRef

from ..http.errors import APIError, FieldNames
from ..http.fields import bad, integer, kind
from ..pipeline.sampling import OPENAI, Field, SamplingOptions, max_tokens, number
from ..state import NO_DEFAULTS, RequestDefaults, ServerState

FIELDS = OPENAI.select("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                       "stop").but(
    Field("num_predict", "max_tokens", max_tokens(until_full=(-1, -2))),
    Field("repeat_penalty", "repetition_penalty", number()),
    under="options",
    others=FieldNames(fields=(("response_format", "format"), ("chat_template_kwargs", "think"), ("prompt", "messages")),
                      paths=((r"\bresponse_format(\.json_schema)?(\.schema)?\b", "format"),)))
"""Ollama's sampling fields, under `options` (others there, such as num_gpu, num_thread or mirostat, are ignored,
as Ollama ignores what a runner does not use), and its names for chat's other fields."""
NAMES = FIELDS.names
"""Ollama's names for chat's fields (chat; /api/generate's prompt is `prompt`)."""
GENERATE_NAMES = NAMES.but(prompt="prompt")
ROLES = ("system", "user", "assistant", "tool")


def now_iso() -> str:
    """Ollama's ``created_at``: the current UTC time, ISO 8601 with a Z."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def check_model_name(state: ServerState, name: Any) -> None:
    """404 unless `name` is absent, the served model's name, or that name with Ollama's ``:latest`` tag, or a LoRA
    adapter's name (`gpullama.server.adapters`)."""
    if name is None or name == "":
        return
    if not isinstance(name, str):
        raise bad("model", "'model' must be a string")
    if name not in (state.model_name, f"{state.model_name}:latest") and \
            state.config.defaults.lora_of_model(name) is None:
        raise APIError(404, f"model '{name}' not found; this server serves '{state.model_name}'", param="model",
                       code="model_not_found")


def options(body: dict, max_model_len: int, defaults: RequestDefaults = NO_DEFAULTS) -> SamplingOptions:
    """The sampling options of `options` (`defaults`: the server's values of those it leaves out), and its
    `num_ctx` checked against the server's context."""
    opts = FIELDS.read(body, defaults=defaults)
    num_ctx = (body.get("options") or {}).get("num_ctx")
    if num_ctx is not None:
        if integer(num_ctx, "options.num_ctx") < 1:
            raise bad("options.num_ctx", f"'options.num_ctx' must be a positive integer, got {num_ctx!r}")
        if num_ctx > max_model_len:
            raise bad("options.num_ctx", f"'options.num_ctx' is {num_ctx}, more than this server's context of "
                      f"{max_model_len} tokens (gpullama-serve --max-model-len)")
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


def with_images(text: str, images: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content with Ollama's ``images`` (base64 strings, or data URLs) before its text, as chat parts;
    the text alone without images."""
    if not images:
        return text
    if not isinstance(images, list):
        raise bad(where, f"'{where}' must be a list of base64-encoded images, got {kind(images)}")
    parts: list[dict[str, Any]] = []
    for i, image in enumerate(images):
        if not isinstance(image, str):
            raise bad(f"{where}[{i}]", f"'{where}[{i}]' must be a base64 string, got {kind(image)}")
        parts.append({"type": "image", "image": ImageRef(image, f"{where}[{i}]")})
    return [*parts, {"type": "text", "text": text}] if text else parts


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """Ollama chat messages in chat completions' shape: assistant ``tool_calls`` with object arguments get ids and
    JSON strings, ``tool`` messages their ``tool_name`` as ``name``, ``thinking`` the ``reasoning_content``."""
    out = []
    calls_seen = 0
    for where, message in message_items(value):
        role = role_of(message, where, ROLES)
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"'{where}.content' must be a string, got {kind(content)}")
        entry: dict[str, Any] = {"role": role, "content": with_images(content, message.get("images"), f"{where}.images")}
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
