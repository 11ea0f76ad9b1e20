"""Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3) or ``[TOOL_CALLS]name[ARGS]{...}``
(v11+); the template renders the tools."""

from __future__ import annotations

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.tool_calls import NAME_CHARS, EndOfText, NotACall, Scan, ToolParser
from gpullama.structured.tools import TOOL_CALL_FORMATS

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3), or ``[TOOL_CALLS]name[ARGS]{...}``
    (v11+, one call per marker)."""

    name = "mistral"
    markers = (TOOL_CALLS,)
    ARGS = ARGS
    token_markers = (TOOL_CALLS, ARGS)

    def _region_scan(self) -> Scan:
        c = yield from self._skip_ws((yield))
        if c == "[":
            return (yield from self._calls_list(c))
        if c == "{":
            return (yield from self._call(c))
        name = []
        while c is not None and c in NAME_CHARS:
            name.append(c)
            c = yield
        for expected in ARGS:
            if c != expected:
                raise NotACall
            c = yield
        if not self._valid_name("".join(name)):
            raise NotACall
        self._begin("".join(name))
        c = yield from self._skip_ws(c)
        try:
            if c is None:
                raise EndOfText
            c = yield from self._arguments(c, self._args)
        except EndOfText:
            c = None
        self._end()
        return c


FORMAT = ChatToolFormat("mistral", MistralToolParser, TOOL_CALL_FORMATS["mistral"], lambda source: TOOL_CALLS in source)
