"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated; the
template renders the tools itself (in ``<tools>``)."""

from __future__ import annotations

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.tool_calls import NotACall, Scan, ToolParser
from gpullama.structured.tools import TOOL_CALL_FORMATS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"


class HermesToolParser(ToolParser):
    """Calls in ``<tool_call>`` tags, committed (id and name streamed) once the name is read.

    With the offered tools known (`tool_names`), the open tag is optional, as in llama.cpp's parser: a call object
    written bare or inside a code fence (```` ```json ````, with or without the tags inside) counts when it names
    an offered tool and its arguments parse as a JSON object (Qwen2.5-Coder writes its calls so). Such a call is
    held back until its object is complete; JSON that names no offered tool stays content.
    """

    name = "hermes"
    markers = (OPEN,)
    CLOSE = CLOSE
    token_markers = (OPEN, CLOSE)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.tool_names is not None:
            self.markers = (OPEN, FENCE)
            self.open_chars = "{"

    def _region_scan(self) -> Scan:
        if self._trigger == OPEN:
            return (yield from self._tagged())
        return (yield from self._lenient(fenced=self._trigger == FENCE))

    def _tagged(self) -> Scan:
        c = yield from self._skip_ws((yield))
        if c != "{":
            raise NotACall
        c = yield from self._call(c)
        matched = 0  # the close tag; anything else before it is dropped
        while c is not None:
            if c == CLOSE[matched]:
                matched += 1
                if matched == len(CLOSE):
                    return None
            else:
                matched = 1 if c == CLOSE[0] else 0
            c = yield
        return None

    def _tag(self, c: str) -> Scan:
        """A ``<tool_call>`` or ``</tool_call>`` tag starting at `c` == '<' (NotACall for anything else); return
        the character after it."""
        text = c
        while len(text) < len(CLOSE) and text in (OPEN[:len(text)], CLOSE[:len(text)]) and text not in (OPEN, CLOSE):
            c = yield
            if c is None:
                raise NotACall
            text += c
        if text not in (OPEN, CLOSE):
            raise NotACall
        return (yield)

    def _lenient(self, fenced: bool) -> Scan:
        """Calls without the open tag: bare call objects, or a fence (its language tag, then the objects, each
        maybe in tags, then the closing fence)."""
        c = yield
        if fenced:
            while c is not None and c.isalpha():  # the fence's language tag
                c = yield
            c = yield from self._skip_ws(c)
            if c == "<":
                c = yield from self._skip_ws((yield from self._tag(c)))
        if c != "{":
            raise NotACall
        c = yield from self._whole_call(c)
        while True:
            c = yield from self._skip_ws(c)
            if c == "<":
                self._set_mark()
                c = yield from self._tag(c)
            elif c == "{":
                self._set_mark()
                c = yield from self._whole_call(c)
            elif c == "`" and fenced:
                self._set_mark()
                for _ in FENCE:
                    if c != "`":
                        raise NotACall
                    c = yield
                return c
            else:
                return c


FORMAT = ChatToolFormat("hermes", HermesToolParser, TOOL_CALL_FORMATS["hermes"], lambda source: OPEN in source)
