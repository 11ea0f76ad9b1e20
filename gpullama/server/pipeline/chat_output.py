"""A chat answer split into reasoning, content and tool calls, whole or streamed (the same either way), as the
fields of an OpenAI message or delta (``content``, ``reasoning_content``, ``tool_calls``), with the finish reason
OpenAI gives it; the other API families build their answers from these fields."""

from __future__ import annotations

from typing import Any

from gpullama.chat.output import ChatDelta, ChatOutputParser, accumulate_chat

from .chat_plan import ChatPlan


class ChatOutputShaper:
    """Reads each choice's text with the plan's parsers: a reasoning parser when the model reasons, a tool parser
    in the template's format when tools are offered. One instance per request; choices are kept apart."""

    def __init__(self, plan: ChatPlan, prompt: str) -> None:
        self.plan = plan
        self._prompt = prompt
        self._parsers: dict[int, ChatOutputParser] = {}
        self._called: set[int] = set()  # choices that called tools

    @property
    def active(self) -> bool:
        """Whether the text needs reading at all (otherwise it is plain content)."""
        return self.plan.format.reasoning or self.plan.tool_names is not None

    def _parser(self, index: int) -> ChatOutputParser:
        parser = self._parsers.get(index)
        if parser is None:
            plan = self.plan
            reasoning = plan.format.tools.reasoning_parser(self._prompt) if plan.format.reasoning else None
            parser = self._parsers[index] = plan.format.tools.output_parser(plan.tool_names, reasoning)
        return parser

    def message(self, index: int, text: str) -> dict[str, Any]:
        """The ``message`` of a whole choice."""
        parser = self._parser(index)
        out = accumulate_chat(self._keep(d) for d in (parser.feed(text), parser.finish()))
        calls = [c.to_openai() for c in out.tool_calls]
        message: dict[str, Any] = {"role": "assistant",
                                   "content": out.content if out.content is not None or calls else ""}
        if calls:
            message["tool_calls"] = calls
        if self.plan.format.reasoning:
            message["reasoning_content"] = message["reasoning"] = out.reasoning
        if calls:
            self._called.add(index)
        return message

    def delta(self, index: int, text: str) -> dict[str, Any] | None:
        """The ``delta`` fields that a streamed piece of choice `index` settles (None when it settles nothing)."""
        return self._fields(index, self._keep(self._parser(index).feed(text)))

    def finish(self, index: int) -> dict[str, Any] | None:
        """The ``delta`` fields of what choice `index` held back when it ended (None when nothing)."""
        return self._fields(index, self._keep(self._parser(index).finish()))

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        """OpenAI's finish reason: "tool_calls" when the choice called tools and stopped on its own, except for a
        named tool choice, which ends with "stop" (as OpenAI does)."""
        if reason == "stop" and index in self._called and self.plan.tool_choice != "named":
            return "tool_calls"
        return reason

    def _keep(self, delta: ChatDelta) -> ChatDelta:
        """Without parallel_tool_calls, only the first call counts. A forced choice (required or named) has no
        content: its grammar allows only calls, so text outside them is the unfinished tail of a call cut by
        max_tokens, never an answer."""
        if not self.plan.parallel_tool_calls:
            delta.tool_calls = [t for t in delta.tool_calls if t.index == 0]
        if self.plan.tool_choice in ("required", "named"):
            delta.content = ""
        return delta

    def _fields(self, index: int, delta: ChatDelta) -> dict[str, Any] | None:
        if not delta:
            return None
        fields: dict[str, Any] = {}
        if delta.reasoning:
            fields["reasoning_content"] = fields["reasoning"] = delta.reasoning
        if delta.content:
            fields["content"] = delta.content
        if delta.tool_calls:
            self._called.add(index)
            fields["tool_calls"] = [t.to_openai() for t in delta.tool_calls]
        return fields
