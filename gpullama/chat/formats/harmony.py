"""gpt-oss's harmony chat format in model output: channels split into reasoning, content and tool calls, whole or
streamed (the same for any split of the text).

After the generation prompt (``<|start|>assistant``) the model writes one or more messages::

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

or, to call a tool (the recipient may also stand before the channel)::

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message's header runs to ``<|message|>``; its body to ``<|end|>``, ``<|call|>``, ``<|return|>`` or the next
``<|start|>`` (llama.cpp renders ``<|start|>``, ``<|channel|>``, ``<|message|>`` and ``<|constrain|>`` always, and
``<|end|>`` only when kept, so either may close a message). The analysis channel is reasoning, a message to
``functions.NAME`` is a call of NAME (when tools were offered) whose body is its arguments, every other message is
content. Text that never opens a message is content.
"""

from __future__ import annotations

import re

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.output import ChatDelta
from gpullama.chat.tool_calls import ToolCallDelta, new_call_id

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
"""The harmony format's special tokens: the output text must keep them for the parser."""
_BODY_ENDS = (END, CALL, RETURN, START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def is_harmony_template(source: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's)."""
    return bool(source) and CHANNEL in source and MESSAGE in source


class HarmonyParser:
    """Reads harmony output as `ChatOutputParser` reads other formats: `feed` pieces, then `finish`; each returns
    the reasoning, content and tool-call pieces the text settles. `tool_names` None: no tools were offered, so
    messages to functions are content."""

    token_markers = MARKERS

    def __init__(self, tool_names: list[str] | None = None) -> None:
        self._tools = tool_names is not None
        self._held = ""  # text not yet settled: a header, or the end of a body that may begin a marker
        self._in_body = False
        self._kind = "content"  # the open body's: "reasoning", "content" or "call"
        self._seen_message = False
        self._calls = 0

    def feed(self, text: str) -> ChatDelta:
        """Take the next piece of output text."""
        out = ChatDelta()
        self._held += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ChatDelta:
        """The output ended: settle what is held back (an open body ends with the text)."""
        out = ChatDelta()
        while self._step(out, final=True):
            pass
        held, self._held = self._held, ""
        if self._in_body:
            self._emit(out, held)
        elif held and not self._seen_message:  # no harmony message at all: plain content
            out.content += held
        return out

    def _step(self, out: ChatDelta, final: bool) -> bool:
        """Settle what the held text allows; True when it changed state (call again)."""
        if not self._in_body:
            at = self._held.find(MESSAGE)
            if at < 0:
                return False
            header, self._held = self._held[:at], self._held[at + len(MESSAGE):]
            self._open(header, out)
            return True
        ends = [(i, m) for m in _BODY_ENDS if (i := self._held.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(out, self._held[:at])
            self._held = self._held[at + (0 if marker == START else len(marker)):]
            self._in_body = False
            return True
        keep = 0 if final else _partial_marker(self._held)
        self._emit(out, self._held[: len(self._held) - keep])
        self._held = self._held[len(self._held) - keep:]
        return False

    def _open(self, header: str, out: ChatDelta) -> None:
        """A message body begins: its header says what it is."""
        header = header[header.rfind(START) + len(START):] if START in header else header
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        channel = re.split(r"[\s<]", channel.strip(), maxsplit=1)[0] if channel.strip() else ""
        recipient = _RECIPIENT.search(header)
        self._in_body, self._seen_message = True, True
        if recipient and recipient.group(1).startswith("functions.") and self._tools:
            self._kind = "call"
            out.tool_calls.append(ToolCallDelta(self._calls, new_call_id(), recipient.group(1)[len("functions."):]))
            self._calls += 1
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"

    def _emit(self, out: ChatDelta, text: str) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            out.reasoning += text
        elif self._kind == "call":
            out.tool_calls.append(ToolCallDelta(self._calls - 1, arguments=text))
        else:
            out.content += text


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of a marker that ends a body."""
    for k in range(min(len(text), max(map(len, _BODY_ENDS)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in _BODY_ENDS):
            return k
    return 0


FORMAT = ChatToolFormat("harmony", HarmonyParser, None, is_harmony_template,
                        output=lambda fmt, tool_names, reasoning: HarmonyParser(tool_names),
                        channels="gpt-oss's harmony channels")
"""The harmony format: the template renders the tools; its parser reads the whole output (reasoning included), and
its calls cannot be forced (it has no grammar form) nor its output constrained."""
