"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated; the
template renders the tools itself (in ``<tools>``)."""

from __future__ import annotations

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.tool_calls import NotACall, Scan, ToolParser
from gpullama.structured.tools import TOOL_CALL_FORMATS

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """Calls in ``<tool_call>`` tags, committed (id and name streamed) once the name is read."""

    name = "hermes"
    markers = (OPEN,)
    CLOSE = CLOSE
    token_markers = (OPEN, CLOSE)

    def _region_scan(self) -> Scan:
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


FORMAT = ChatToolFormat("hermes", HermesToolParser, TOOL_CALL_FORMATS["hermes"], lambda source: OPEN in source)
