"""What a chat format is: how its template is recognised, how tools and earlier calls reach its prompt, the text a
call is written as (the grammar's form, for forced calls) and the parser that reads calls back out of the output."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpullama.chat.output import ChatOutputParser
from gpullama.chat.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningParser, prompt_opens_reasoning
from gpullama.chat.tool_calls import ToolParser
from gpullama.structured.spec import StructuredOutputError
from gpullama.structured.tools import ToolCallFormat

# (messages, offered tools or None, tool_choice, parallel_tool_calls) -> the messages the template renders
PromptMessages = Callable[[Sequence[dict[str, Any]], Sequence[Any] | None, Any, bool], list[dict[str, Any]]]


def call_arguments(call: Any, where: str) -> tuple[str, str | None, Any]:
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
            _, _, args = call_arguments(call, f"{where}[{j}]")
            call["function"]["arguments"] = args
    return out


def _template_renders(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None, tool_choice: Any,
                      parallel_tool_calls: bool) -> list[dict[str, Any]]:
    return template_messages(messages)


def _reasoning_then_calls(tools: ChatToolFormat, tool_names: list[str] | None,
                          reasoning: ReasoningParser | None) -> ChatOutputParser:
    if reasoning is not None and tools.reasoning_ends:
        reasoning.end_markers = tools.reasoning_ends
    return ChatOutputParser(reasoning, tools.parser(tool_names) if tool_names is not None else None)


@dataclass(frozen=True)
class ChatToolFormat:
    """One tool-call format: its name, whether a chat template's source is written for it, the parser of its
    calls, the text form its forced calls take (`gpullama.structured.tools.TOOL_CALL_FORMATS`, which the grammar
    engine reads), how the request's messages and tools reach the prompt (the template renders them itself, or the
    format writes its own tool prompt), and how a whole answer is read."""

    name: str
    parser: type[ToolParser]
    grammar: ToolCallFormat | None  # None: the format's calls cannot be forced
    detects: Callable[[str], bool]
    template_tools: bool = True  # the chat template renders the tools and the earlier calls
    prompt_messages: PromptMessages = _template_renders
    # the answer's reader: by default the <think> parser (when the model reasons), then this format's call parser
    output: Callable[[ChatToolFormat, list[str] | None, ReasoningParser | None], Any] = _reasoning_then_calls
    reasoning_ends: tuple[str, ...] = ()  # markers that also end a <think> block, and begin the answer (a call)
    think_tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)  # what opens and closes a reasoning block
    channels: str = ""  # the format's own markers carry reasoning, answer and calls (what they are, for errors):
    # the model always reasons, those markers are the ones its text must keep, and no grammar may constrain it

    @property
    def token_markers(self) -> tuple[str, ...]:
        """The format's words that a vocabulary may hold as special tokens (the output must keep them)."""
        return self.parser.token_markers

    def reasoning_parser(self, prompt: str) -> ReasoningParser:
        """A fresh reader of this format's reasoning blocks (`think_tags`), already inside one when the rendered
        `prompt` leaves the model in one."""
        open_tag, close_tag = self.think_tags
        return ReasoningParser(prompt_opens_reasoning(prompt, open_tag, close_tag), open_tag, close_tag)

    def output_parser(self, tool_names: list[str] | None, reasoning: ReasoningParser | None) -> Any:
        """A fresh reader of one answer (``feed`` pieces, then ``finish``; each a `ChatDelta`): calls of
        `tool_names` (None: no tools were offered; a mapping of names to parameters schemas types the values of
        tagged formats), reasoning through `reasoning` unless the format reads it itself."""
        return self.output(self, tool_names, reasoning)
