"""Reasoning in model output: text inside ``<think>...</think>`` split from the answer, whole or streamed."""

from __future__ import annotations

from dataclasses import dataclass

_WS = " \t\r\n"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    """What one piece of text turned into: reasoning text and answer (content) text."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def prompt_opens_reasoning(prompt: str, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> bool:
    """Whether a rendered prompt leaves the model inside a reasoning block (it ends with an unclosed open tag,
    as DeepSeek-R1 distill templates render the generation prompt), so the output starts as reasoning."""
    last_open = prompt.rfind(open_tag)
    return last_open >= 0 and prompt.rfind(close_tag) < last_open and not prompt[last_open + len(open_tag):].strip()


class ReasoningParser:
    """Splits reasoning from the answer, fed the whole text or any pieces of it (same result for any split).

    The output is reasoning when it starts with `open_tag` (leading whitespace allowed) or when
    `start_in_reasoning` (the prompt opened the block; a repeated open tag is then dropped); the reasoning runs
    to `close_tag`, one of `end_markers` (which then begins the answer) or the end of the text. An open tag anywhere else is answer text. Whitespace around the
    reasoning and at the start of the answer after it is dropped.
    """

    def __init__(self, start_in_reasoning: bool = False, open_tag: str = THINK_OPEN,
                 close_tag: str = THINK_CLOSE) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        # states: "start" (before the answer, looking for open_tag), "think", "after" (dropping whitespace after
        # close_tag), "answer"
        self._state = "think" if start_in_reasoning else "start"
        self._may_reopen = start_in_reasoning  # a leading open tag inside an already open block is dropped
        self._held = ""  # text not yet known to be reasoning/answer (whitespace, a partial tag)
        self._reasoning_started = False
        self.reasoning_ended = False  # True once close_tag was seen: what follows is the answer
        self._out = ReasoningDelta()
        # markers that also end the reasoning and begin the answer, kept in it (Qwen3.5's <tool_call>); set by the
        # chat format before the first feed
        self.end_markers: tuple[str, ...] = ()

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would be reasoning."""
        return self._state == "think"

    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of output; return the reasoning and answer text it settles."""
        for i, c in enumerate(text):
            if self._state == "answer":  # the rest of the text is answer: pass it through whole
                self._out.content += text[i:]
                break
            self._char(c)
        return self._take()

    def finish(self) -> ReasoningDelta:
        """The output ended: settle the text held back."""
        held, self._held = self._held, ""
        if self._state == "start":
            self._out.content += held
        elif self._state == "think":
            self._emit_reasoning(held.rstrip(_WS) if self._reasoning_started else held.strip(_WS))
        self._state = "answer"
        return self._take()

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part. Use a fresh parser."""
        a, b = self.feed(text), self.finish()
        reasoning, content = a.reasoning + b.reasoning, a.content + b.content
        return reasoning or None, content or None

    def _take(self) -> ReasoningDelta:
        out, self._out = self._out, ReasoningDelta()
        return out

    def _char(self, c: str) -> None:
        held = self._held + c
        if self._state == "start":
            body = held.lstrip(_WS)
            if self.open_tag.startswith(body):
                if body == self.open_tag:
                    self._state, self._held = "think", ""
                else:
                    self._held = held
                return
            self._state, self._held = "answer", ""
            self._out.content += held
        elif self._state == "after":
            if c in _WS:
                return
            self._state = "answer"
            self._out.content += c
        else:
            self._think(held)

    def _think(self, held: str) -> None:
        """Inside the reasoning: hold trailing whitespace and a partial close tag, emit the rest."""
        if not self._reasoning_started:
            body = held.lstrip(_WS)
            if self._may_reopen and body and self.open_tag.startswith(body):
                self._held = held if body != self.open_tag else ""
                if body == self.open_tag:
                    self._may_reopen = False
                return
            self._may_reopen = False
            if not body:
                self._held = ""  # whitespace before the reasoning
                return
            held = body
        if held.endswith(self.close_tag):
            self._emit_reasoning(held[:-len(self.close_tag)].rstrip(_WS))
            self._held, self._state, self.reasoning_ended = "", "after", True
            return
        marker = next((m for m in self.end_markers if held.endswith(m)), None)
        if marker is not None:  # the answer begins with the marker
            self._emit_reasoning(held[:-len(marker)].rstrip(_WS))
            self._held, self._state, self.reasoning_ended = "", "answer", True
            self._out.content += marker
            return
        k = max(_partial_suffix(held, tag) for tag in (self.close_tag, *self.end_markers))
        text, tail = held[:len(held) - k], held[len(held) - k:]
        stripped = text.rstrip(_WS)
        self._emit_reasoning(stripped)
        self._held = text[len(stripped):] + tail

    def _emit_reasoning(self, text: str) -> None:
        if text:
            self._reasoning_started = True
            self._out.reasoning += text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
