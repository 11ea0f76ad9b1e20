"""Tools in the prompt: messages with tool calls made ready for a chat template, and the generic tool prompt
for templates without tool support (the format `GenericToolParser` reads)."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from gpullama.structured.spec import StructuredOutputError
from gpullama.structured.tools import TOOL_CALL_FORMATS, parse_tool


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_arguments(call: Any, where: str) -> tuple[str, str | None, Any]:
    """(name, id, arguments object) of one assistant ``tool_calls`` entry; errors name the field."""
    if not isinstance(call, dict):
        raise StructuredOutputError(f"{where} must be an object", where)
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict):
        raise StructuredOutputError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise StructuredOutputError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise StructuredOutputError(f"{where}.function.arguments is not valid JSON",
                                        f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise StructuredOutputError(f"{where}.function.arguments must be a JSON object",
                                    f"{where}.function.arguments")
    call_id = call.get("id")
    return name, call_id if isinstance(call_id, str) else None, args


def template_messages(messages: Sequence[dict[str, Any]], param: str = "messages") -> list[dict[str, Any]]:
    """A copy of `messages` for a template with tool support: each assistant call's ``arguments`` parsed
    from its JSON string into an object (templates render it with ``tojson``). Malformed calls raise
    StructuredOutputError naming the field."""
    out = copy.deepcopy(list(messages))
    for i, message in enumerate(out):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls is None:
            continue
        where = f"{param}[{i}].tool_calls"
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise StructuredOutputError(f"{where} must be a list, on an assistant message", where)
        for j, call in enumerate(calls):
            _, _, args = _call_arguments(call, f"{where}[{j}]")
            call["function"]["arguments"] = args
    return out


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
            parsed = [_call_arguments(c, f"{where}[{j}]") for j, c in enumerate(calls)]
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
