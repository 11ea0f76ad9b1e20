"""A chat answer split into reasoning, content and tool calls, whole or streamed (the same either way)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gpullama.chat.reasoning import ReasoningDelta, ReasoningParser
from gpullama.chat.tool_calls import ParsedDelta, ToolCall, ToolCallDelta, ToolParser, accumulate


@dataclass
class ChatDelta:
    """One piece of a chat answer, split: reasoning text, content text and tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ChatOutput:
    """A whole chat answer, split: reasoning (None if none), content (None if none) and tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChatOutputParser:
    """The reasoning parser first, then the tool parser on the answer only (a call written inside the
    reasoning is reasoning text). Either may be None. Same result for any split of the text."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self._reasoning_text: list[str] = []

    def feed(self, text: str) -> ChatDelta:
        """Take the next piece of output text."""
        return self._split(self.reasoning.feed(text) if self.reasoning else ReasoningDelta(content=text), False)

    def finish(self) -> ChatDelta:
        """The output ended: settle what is held back."""
        return self._split(self.reasoning.finish() if self.reasoning else ReasoningDelta(), True)

    def parse(self, text: str) -> ChatOutput:
        """Reasoning, content and calls of a whole output (use a fresh parser)."""
        return accumulate_chat([self.feed(text), self.finish()])

    def _split(self, piece: ReasoningDelta, final: bool) -> ChatDelta:
        out = ChatDelta(reasoning=piece.reasoning)
        if self.tools is None:
            out.content = piece.content
            return out
        parts = [self.tools.feed(piece.content)] if piece.content else []
        if final:
            parts.append(self.tools.finish())
        for p in parts:
            out.content += p.content
            out.tool_calls.extend(p.tool_calls)
        return out


def accumulate_chat(deltas: Iterable[ChatDelta]) -> ChatOutput:
    """Join streamed chat pieces as a client does."""
    deltas = list(deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls = accumulate(ParsedDelta(d.content, d.tool_calls) for d in deltas)
    return ChatOutput(reasoning or None, calls.content, calls.tool_calls)
