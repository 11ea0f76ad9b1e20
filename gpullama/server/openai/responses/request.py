"""A ``POST /v1/responses`` body checked and put in the chat shape, so both endpoints share one tool and
structured-output pipeline (`chat_plan.plan_chat`).

`input` items and `instructions` become chat messages: message items as they are, ``function_call`` items as an
assistant message's ``tool_calls``, ``function_call_output`` items as ``tool`` messages, a ``reasoning`` item as
the next assistant message's ``reasoning_content``. The flat function `tools`, `tool_choice` and `text.format`
become chat's `tools`, `tool_choice` and `response_format`; the errors of the common plan and the engine, in
chat's names, are renamed back to the Responses fields (`NAMES`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpullama.chat.messages import content_of, message_items, role_of, text_of

from ...http.errors import FieldNames
from ...http.fields import bad as _bad
from ...http.fields import bool_field, object_body, str_field
from ...http.fields import kind as _kind
from ...pipeline.sampling import OPENAI, Field, SamplingOptions, max_tokens, streamed
from ...state import NO_DEFAULTS, RequestDefaults
from ..chat import CHAT_ROLES

# message items' roles (tool results arrive as function_call_output items)
INPUT_ROLES = {k: v for k, v in CHAT_ROLES.items() if k != "tool"}
TEXT_PARTS = ("input_text", "output_text", "text")
TOOL_CHOICES = ("none", "auto", "required")
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
FIELDS = OPENAI.but(
    Field("max_output_tokens", "max_tokens", max_tokens()), Field("return_progress", "return_progress", streamed),
    without=("max_tokens", "max_completion_tokens"),
    others=FieldNames(
        fields=(("prompt", "input"),),
        paths=((r"\btools\[(\d+)\]\.function\b", r"tools[\1]"), (r"\bresponse_format(\.json_schema)?\b", "text.format"),
               (r"\bmessages(\[\d+\][\w.\[\]]*)?", "input"))))
"""The sampling fields a Responses request may carry (OpenAI's, and the extra ones the other endpoints take, as
vLLM does), and its names for chat's fields."""
NAMES = FIELDS.names
"""The Responses names for chat's fields (``tools[0].function.name`` is ``tools[0].name``,
``response_format.json_schema.schema`` is ``text.format.schema``, the messages are the input)."""


@dataclass
class ResponsesRequest:
    """A validated ``POST /v1/responses`` body: chat messages, sampling options, and the chat-shaped tool and
    format fields for `plan_chat`."""

    model: str | None
    messages: list[dict[str, Any]]
    options: SamplingOptions
    stream: bool
    instructions: str | None
    chat_fields: dict[str, Any] = field(default_factory=dict)  # tools, tool_choice, parallel_tool_calls, ...
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{where}.{key}", f"'{where}.{key}' must be a non-empty string, got {_kind(value)}")
    return value


def _function_call(item: dict, where: str) -> dict[str, Any]:
    """A ``function_call`` input item as a chat ``tool_calls`` entry; its arguments must be a JSON object."""
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise _bad(f"{where}.arguments", f"'{where}.arguments' must be a string of JSON, got {_kind(arguments)}")
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise _bad(f"{where}.arguments", f"'{where}.arguments' must be a JSON object written as a string")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reasoning_text(item: dict, where: str) -> str:
    """The text of a ``reasoning`` input item: its ``reasoning_text`` content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise _bad(f"{where}.content", f"'{where}.content' must be a list of reasoning_text parts")
    return "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def input_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages of the `input` field: a string is one user message; a list holds message items
    (``{"role", "content"}``, with or without ``"type": "message"``), ``function_call`` items (joined to the
    assistant message before them, as its ``tool_calls``), ``function_call_output`` items (``tool`` messages) and
    ``reasoning`` items (the next assistant message's ``reasoning_content``)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool messages of their outputs
    reasoning = ""

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        nonlocal reasoning
        if reasoning:
            message["reasoning_content"], reasoning = reasoning, ""
        return message

    for where, item in message_items(value, "input"):
        kind = item.get("type", "message")
        if kind == "message":
            role = role_of(item, where, tuple(INPUT_ROLES))
            message = {"role": INPUT_ROLES[role],
                       "content": content_of(item.get("content"), f"{where}.content", TEXT_PARTS)}
            messages.append(assistant(message) if message["role"] == "assistant" else message)
        elif kind == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if "output" not in item:
                raise _bad(f"{where}.output", f"'{where}.output' is required")
            message = {"role": "tool", "tool_call_id": call_id, "content": text_of(item["output"], f"{where}.output", TEXT_PARTS)}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        else:
            raise _bad(f"{where}.type", f"'{where}.type' {str(kind)[:40]!r} is not supported: input items are "
                       f"{', '.join(INPUT_ITEM_TYPES)} (this server stores no items to reference)")
    return messages


def _tools(value: Any) -> tuple[list[dict] | None, list[dict]]:
    """(chat-shaped tools for plan_chat, the tools as the response repeats them) of the flat function tools."""
    if value is None or value == []:
        return None, []
    if not isinstance(value, list):
        raise _bad("tools", f"'tools' must be a list of tool objects, got {_kind(value)}")
    chat, echo = [], []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, f"'{where}' must be an object, got {_kind(tool)}")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", f"'{where}.type' must be 'function' (this server has function tools only, "
                       f"no hosted tools), got {str(tool.get('type'))[:40]!r}")
        for key, kind in (("description", str), ("strict", bool)):
            if tool.get(key) is not None and not isinstance(tool[key], kind):
                raise _bad(f"{where}.{key}", f"'{where}.{key}' must be a {kind.__name__}, got {_kind(tool[key])}")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        chat.append({"type": "function", "function": function})
        echo.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                     "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    return chat, echo


def _tool_choice(value: Any, tools: list | None) -> Any:
    """The chat `tool_choice` of a Responses one (``{"type": "function", "name": N}`` named in chat's shape)."""
    if value is None or (value == "auto" and not tools):  # "auto" without tools: nothing to choose from
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise _bad("tool_choice", f"'tool_choice' must be one of {list(TOOL_CHOICES)} or "
                       f"{{'type': 'function', 'name': ...}}, got {value[:40]!r}")
        return value
    if not isinstance(value, dict) or value.get("type") != "function":
        raise _bad("tool_choice", "'tool_choice' must be one of 'none', 'auto', 'required' or "
                   "{'type': 'function', 'name': ...} (function tools only)")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("tool_choice.name", "'tool_choice.name' must be a non-empty string")
    return {"type": "function", "function": {"name": name}}


def _response_format(text: Any) -> tuple[dict | None, dict]:
    """(chat `response_format`, the format as the response repeats it) of ``text.format``."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise _bad("text", f"'text' must be an object, got {_kind(text)}")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict):
        raise _bad("text.format", f"'text.format' must be an object, got {_kind(fmt)}")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}, {"type": kind}
    if kind == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}, {"type": "json_schema", **inner}
    raise _bad("text.format.type", f"'text.format.type' must be one of 'text', 'json_object', 'json_schema', "
               f"got {str(kind)[:40]!r}")


def _refuse_unsupported(body: dict) -> None:
    """Fields whose feature this server does not have: one clear 400 each, rather than a silent different answer."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        param = "previous_response_id" if body.get("previous_response_id") is not None else "conversation"
        raise _bad(param, f"'{param}' is not supported: this server stores no responses; send the whole "
                   "conversation in 'input'")
    if body.get("background"):
        raise _bad("background", "'background' responses are not supported")


def parse_responses(body: Any, defaults: RequestDefaults = NO_DEFAULTS) -> ResponsesRequest:
    """Validate a Responses body (`defaults`: the server's values of sampling fields it leaves out); raises
    ``APIError`` (400) naming the bad field. The tool and format fields are checked further by `plan_chat` (whose
    errors `NAMES` renames)."""
    body = object_body(body)
    _refuse_unsupported(body)
    model = str_field(body, "model")
    if "input" not in body:
        raise _bad("input", "'input' is a required field")
    messages = input_messages(body["input"])
    instructions = str_field(body, "instructions")
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    tools, tools_echo = _tools(body.get("tools"))
    response_format, format_echo = _response_format(body.get("text"))
    chat_fields = {"tools": tools, "tool_choice": _tool_choice(body.get("tool_choice"), tools),
                   "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": response_format}
    opts = FIELDS.read(body, defaults=defaults)
    stream = bool_field(body, "stream")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _bad("metadata", "'metadata' must be an object of string values")
    choice = body.get("tool_choice")
    echo = {
        "instructions": instructions,
        "max_output_tokens": opts.max_tokens,
        "metadata": metadata or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": opts.kwargs.get("temperature", 1.0),
        "top_p": opts.kwargs.get("top_p", 1.0),
        "text": {"format": format_echo},
        "tool_choice": choice if choice is not None else "auto",
        "tools": tools_echo,
        "truncation": "disabled",
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    return ResponsesRequest(model, messages, opts, stream, instructions, chat_fields, echo)
