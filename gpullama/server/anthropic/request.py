"""A ``POST /v1/messages`` body checked and put in chat completions' shape, as llama.cpp converts it: content blocks
become chat messages (text joined, ``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks
``tool`` messages, ``thinking`` blocks the assistant's ``reasoning_content``), `system` the system message, `tools`
(``input_schema``) and `tool_choice` (auto, any, tool, none) chat's, `thinking` the template's ``enable_thinking``.
The common plan and the engine then name chat's fields; `NAMES` renames them back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpullama.chat.messages import image_part, message_items, role_of, text_of

from ..http.errors import FieldNames
from ..http.fields import bad, bool_field, kind, object_body, str_field
from ..pipeline.sampling import OPENAI, Field, SamplingOptions, stop
from ..state import NO_DEFAULTS, RequestDefaults

FIELDS = OPENAI.select("max_tokens", "temperature", "top_p", "top_k", "seed").but(
    Field("stop_sequences", "stop", stop),
    others=FieldNames(
        fields=(("prompt", "messages"),),
        paths=((r"\btools\[(\d+)\]\.function\.parameters\b", r"tools[\1].input_schema"),
               (r"\btools\[(\d+)\]\.function\b", r"tools[\1]"), (r"\bmessages\[\d+\][\w.\[\]]*", "messages"))))
"""The Messages API's sampling fields (seed is not Anthropic's, but harmless and useful for tests) and its names
for chat's fields. Chat messages do not map one to one onto Anthropic's (a tool result is a message of its own),
so a chat message's index is dropped rather than misplaced."""
NAMES = FIELDS.names
ROLES = ("user", "assistant")
TOOL_CHOICES = ("auto", "any", "tool", "none")


@dataclass
class MessagesRequest:
    """A validated Messages body: chat messages, sampling options, the chat-shaped tool and thinking fields for
    `plan_chat`, and whether it streams."""

    model: str | None
    messages: list[dict[str, Any]]
    options: SamplingOptions
    stream: bool
    chat_fields: dict[str, Any] = field(default_factory=dict)


def _blocks(message: dict, where: str) -> list[dict]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"'{where}.content' must be a string or a list of content blocks, got "
                  f"{kind(content)}")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{where}.content[{j}]", f"'{where}.content[{j}]' must be a content block object")
    return content


def _message(message: dict, where: str) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message (a user message's tool results come first, as their own)."""
    role = role_of(message, where, ROLES)
    texts: list[str] = []
    parts: list[dict] = []  # a user message's text and image blocks in order, when it has an image
    calls: list[dict] = []
    results: list[dict] = []
    reasoning: list[str] = []
    for j, block in enumerate(_blocks(message, where)):
        at, kind_ = f"{where}.content[{j}]", block["type"]
        if kind_ == "text":
            if not isinstance(block.get("text"), str):
                raise bad(f"{at}.text", f"'{at}.text' must be a string")
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind_ == "image" and role == "user":
            parts.append({"type": "image", "image": image_part(block, at)})
        elif kind_ in ("image", "document"):
            raise bad(at, f"'{at}' is an {kind_} block: images go in user messages; documents are not read")
        elif kind_ == "tool_use" and role == "assistant":
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not name:
                raise bad(f"{at}.name", f"'{at}.name' must be a non-empty string")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{at}.id", f"'{at}.id' must be a non-empty string")
            if not isinstance(arguments, dict):
                raise bad(f"{at}.input", f"'{at}.input' must be an object, got {kind(arguments)}")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind_ == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{at}.tool_use_id", f"'{at}.tool_use_id' must be a non-empty string")
            content = block.get("content", "")
            text = text_of(content, f"{at}.content") if content is not None else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind_ == "thinking" and role == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise bad(f"{at}.thinking", f"'{at}.thinking' must be a string")
            reasoning.append(block["thinking"])
        elif kind_ == "redacted_thinking" and role == "assistant":
            continue
        else:
            raise bad(f"{at}.type", f"'{at}.type' {kind_[:40]!r} is not supported in a {role} message")
    out = list(results)
    if role == "assistant":
        entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            entry["tool_calls"] = calls
        if reasoning:
            entry["reasoning_content"] = "\n".join(reasoning)
        out.append(entry)
    elif len(parts) > len(texts):  # images among the blocks: the parts in order (the chat template places them)
        out.append({"role": "user", "content": parts})
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("tools", f"'tools' must be a list of tool objects, got {kind(value)}")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, f"'{where}' must be an object, got {kind(tool)}")
        if tool.get("type") not in (None, "custom"):
            raise bad(f"{where}.type", f"'{where}.type' {str(tool.get('type'))[:40]!r} is a server tool: this server "
                      "has client tools only (name, description, input_schema)")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if function["parameters"] is None:
            raise bad(f"{where}.input_schema", f"'{where}.input_schema' is a required field")
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(value: Any, tools: list | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's ``{"type": auto|any|tool|none, "name",
    "disable_parallel_tool_use"}``."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or value.get("type") not in TOOL_CHOICES:
        raise bad("tool_choice", f"'tool_choice' must be an object with 'type' one of {list(TOOL_CHOICES)}")
    parallel = None
    if value.get("disable_parallel_tool_use") is not None:
        parallel = not bool_field(value, "disable_parallel_tool_use", where="tool_choice.disable_parallel_tool_use")
    kind_ = value["type"]
    if kind_ == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise bad("tool_choice.name", "'tool_choice.name' must be a non-empty string")
        return {"type": "function", "function": {"name": name}}, parallel
    if kind_ == "none" or not tools:
        return ("none" if tools else None), parallel
    return {"auto": "auto", "any": "required"}[kind_], parallel


def _thinking(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking", "'thinking' must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}")
    return {"enable_thinking": value["type"] != "disabled"}


def parse_messages_body(body: Any, count_only: bool = False, defaults: RequestDefaults = NO_DEFAULTS) -> MessagesRequest:
    """Validate a Messages body (`count_only`: a count_tokens body, without max_tokens and sampling); 400 naming
    the field."""
    body = object_body(body)
    model = str_field(body, "model")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": text_of(system, "system")})
    for where, message in message_items(body.get("messages")):
        messages.extend(_message(message, where))
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    chat_fields = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
                   "chat_template_kwargs": _thinking(body.get("thinking")) or None}
    opts, stream = SamplingOptions(names=NAMES), False
    if not count_only:
        opts = FIELDS.read(body, defaults=defaults)
        if opts.max_tokens is None:
            raise bad("max_tokens", "'max_tokens' is a required field")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise bad("metadata", "'metadata' must be an object")
        stream = bool_field(body, "stream")
    return MessagesRequest(model, messages, opts, stream, chat_fields)
