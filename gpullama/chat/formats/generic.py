"""The generic format, llama.cpp's way for templates without tool support: a system prompt that describes the
tools and asks for ``{"name": ..., "arguments": {...}}`` (or an array of them), earlier calls written as that JSON,
tool results as user messages, and the parser of that JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpullama.chat.formats.base import ChatToolFormat, call_arguments
from gpullama.chat.tool_calls import NotACall, Scan, ToolParser
from gpullama.structured.spec import StructuredOutputError
from gpullama.structured.tools import TOOL_CALL_FORMATS, parse_tool


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def generic_tool_prompt(tools: Sequence[Any], tool_choice: Any = "auto", parallel_tool_calls: bool = True) -> str:
    """The system prompt that describes `tools` and the JSON to answer with, for a template without tool
    support; "" when `tool_choice` is "none"."""
    if tool_choice == "none":
        return ""
    lines = [
        "You can call tools. The tools, as JSON (each has a name, a description and a JSON schema of its "
        "arguments):"]
    for i, tool in enumerate(tools):
        name, params = parse_tool(tool, i)
        fn = tool.get("function", tool)
        entry = {"name": name, "description": fn.get("description", ""), "parameters": params}
        lines.append(_dumps(entry))
    lines += [
        "",
        "To call a tool, answer with only a JSON object, and nothing else:",
        '{"name": "<tool name>", "arguments": {<the arguments, following the tool\'s parameters schema>}}',
    ]
    if parallel_tool_calls:
        lines.append("To call several tools at once, answer with a JSON array of such objects.")
    if tool_choice in (None, "auto"):
        lines.append("When no tool is needed, answer the user directly in plain text, without JSON.")
    elif tool_choice == "required":
        lines.append("You must call a tool.")
    else:
        named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else tool_choice
        lines.append(f"You must call the tool {_dumps(named)}.")
    lines.append('A tool\'s result comes back as {"tool_response": {"name": ..., "content": ...}}; '
                 "use it to answer the user.")
    return "\n".join(lines)


def generic_messages(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None, tool_choice: Any = "auto",
                     parallel_tool_calls: bool = True, param: str = "messages") -> list[dict[str, Any]]:
    """`messages` for a template without tool support: the generic tool prompt added to the system message
    (or as a first one), assistant calls written as the generic JSON, tool results as user messages."""
    fmt = TOOL_CALL_FORMATS["generic"]
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, message in enumerate(messages):
        message = dict(message)
        role = message.get("role")
        if message.get("tool_calls") is not None:
            where = f"{param}[{i}].tool_calls"
            calls = message["tool_calls"]
            if role != "assistant" or not isinstance(calls, list):
                raise StructuredOutputError(f"{where} must be a list, on an assistant message", where)
            parsed = [call_arguments(c, f"{where}[{j}]") for j, c in enumerate(calls)]
            names.update({cid: name for name, cid, _ in parsed if cid})
            text = fmt.render([(name, args) for name, _, args in parsed], parallel=len(parsed) > 1)
            content = message.get("content") or ""
            message = {"role": "assistant", "content": f"{content}\n{text}" if content else text}
        elif role == "tool":
            content = message.get("content") or ""
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            response = {"name": message.get("name") or names.get(message.get("tool_call_id"), ""),
                        "content": content}
            message = {"role": "user", "content": _dumps({"tool_response": response})}
        out.append(message)
    prompt = generic_tool_prompt(tools or [], tool_choice, parallel_tool_calls) if tools else ""
    if prompt:
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


class GenericToolParser(ToolParser):
    """The generic format (templates without tools): the whole answer is ``{"name": ..., "arguments": {...}}``
    or a JSON array of such objects, possibly in a ``` code fence. Anything else is content."""

    name = "generic"
    start_chars = "{["
    start_markers = ("```",)

    def _region_scan(self) -> Scan:
        c = yield
        fenced = self._trigger == "```"
        if fenced:
            while c is not None and c.isalpha():  # the fence's language tag
                c = yield
            c = yield from self._skip_ws(c)
        if c == "[":
            c = yield from self._calls_list(c)
        elif c == "{":
            c = yield from self._call(c)
            while True:  # more objects, one per line
                c = yield from self._skip_ws(c)
                if c != "{":
                    break
                self._set_mark()
                c = yield from self._call(c)
        else:
            raise NotACall
        if fenced:
            c = yield from self._skip_ws(c)
            for _ in range(3):
                if c != "`":
                    break
                c = yield
        return c


FORMAT = ChatToolFormat("generic", GenericToolParser, TOOL_CALL_FORMATS["generic"], lambda source: True,
                        template_tools=False, prompt_messages=generic_messages)
