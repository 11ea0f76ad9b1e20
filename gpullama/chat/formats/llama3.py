"""Llama 3.1 / 3.2 JSON tool calling: ``{"name": ..., "parameters": {...}}``; the template renders the tools."""

from __future__ import annotations

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.tool_calls import NotACall, Scan, ToolParser
from gpullama.structured.tools import TOOL_CALL_FORMATS

PYTHON_TAG = "<|python_tag|>"


class Llama3ToolParser(ToolParser):
    """Llama 3.x JSON: ``{"name": ..., "parameters": {...}}`` at the start of the output or after
    ``<|python_tag|>``, several separated by ``;``."""

    name = "llama3"
    markers = (PYTHON_TAG,)
    start_chars = "{"
    token_markers = (PYTHON_TAG,)

    def _region_scan(self) -> Scan:
        c = yield from self._skip_ws((yield))
        while True:
            if c != "{":
                raise NotACall
            c = yield from self._call(c)
            c = yield from self._skip_ws(c)
            if c is None:
                return None
            self._set_mark()
            if c == ";":
                c = yield from self._skip_ws((yield))
                if c is None:
                    return None


FORMAT = ChatToolFormat("llama3", Llama3ToolParser, TOOL_CALL_FORMATS["llama3"],
                        lambda source: PYTHON_TAG in source or "ipython" in source)
