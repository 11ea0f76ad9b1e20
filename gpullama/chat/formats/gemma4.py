"""Gemma 4 tool calls and reasoning, as llama.cpp reads them (``common/parsers/gemma4.cpp``)::

    <|channel>thought
    The user wants the weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

A call's arguments are Gemma's own object syntax: bare keys, strings between ``<|"|>`` marks, numbers, booleans and
null as in JSON, nested objects and arrays; they come out as compact JSON (llama.cpp's ``gemma4_to_json``). The
reasoning block runs from ``<|channel>thought`` to ``<channel|>`` (the prompt closes an empty one unless
``enable_thinking``); the template renders the tools and the earlier calls and results itself."""

from __future__ import annotations

import json

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.tool_calls import EndOfText, NotACall, Scan, ToolParser, _Bad
from gpullama.structured.tools import TOOL_CALL_FORMATS

OPEN, CLOSE, PREFIX, QUOTE = "<|tool_call>", "<tool_call|>", "call:", '<|"|>'
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought", "<channel|>"
_WS = " \t\r\n"


def is_gemma4_template(source: str) -> bool:
    """Whether a chat template writes Gemma 4's calls (llama.cpp's test: the literal ``'<|tool_call>call:'``)."""
    return f"'{OPEN}{PREFIX}'" in source


def gemma4_to_json(text: str) -> str:
    """Gemma 4's object syntax as compact JSON text; ValueError where it is malformed."""
    out, end = _value(text, _skip(text, 0))
    if _skip(text, end) != len(text):
        raise ValueError(f"text after the value at {end}")
    return out


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value(text: str, i: int) -> tuple[str, int]:
    """(JSON of the value at `i`, the index after it)."""
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise ValueError("unterminated string")
        return json.dumps(text[i + len(QUOTE):end], ensure_ascii=False), end + len(QUOTE)
    if text.startswith("{", i):
        parts, i = [], _skip(text, i + 1)
        while not text.startswith("}", i):
            colon = i
            while colon < len(text) and text[colon] not in ":}":
                colon += 1
            if colon >= len(text) or text[colon] != ":" or colon == i:
                raise ValueError(f"bad key at {i}")
            key = text[i:colon]
            value, i = _value(text, _skip(text, colon + 1))
            parts.append(json.dumps(key, ensure_ascii=False) + ":" + value)
            i = _skip(text, i)
            if text.startswith(",", i):
                i = _skip(text, i + 1)
            elif not text.startswith("}", i):
                raise ValueError(f"expected ',' or '}}' at {i}")
        return "{" + ",".join(parts) + "}", i + 1
    if text.startswith("[", i):
        parts, i = [], _skip(text, i + 1)
        while not text.startswith("]", i):
            value, i = _value(text, i)
            parts.append(value)
            i = _skip(text, i)
            if text.startswith(",", i):
                i = _skip(text, i + 1)
            elif not text.startswith("]", i):
                raise ValueError(f"expected ',' or ']' at {i}")
        return "[" + ",".join(parts) + "]", i + 1
    decoder = json.JSONDecoder()
    try:
        value, end = decoder.raw_decode(text, i)
    except ValueError:
        raise ValueError(f"bad value at {i}") from None
    if isinstance(value, (dict, list, str)):
        raise ValueError(f"bad value at {i}")
    return text[i:end], end


class Gemma4ToolParser(ToolParser):
    """``<|tool_call>call:NAME{...}<tool_call|>``, repeated; committed once the name is read (an unknown name, or
    no ``call:``, stays content); the arguments come whole once the call closes (a call cut off, or arguments
    that are not Gemma's object syntax, keep ``{}``)."""

    name = "gemma4"
    markers = (OPEN,)
    token_markers = (OPEN, CLOSE, QUOTE)

    def _region_scan(self) -> Scan:
        c = yield
        try:
            c = yield from self._literal(c, PREFIX)
        except (_Bad, EndOfText):
            raise NotACall from None
        name = []
        while c is not None and c not in "{<" and c not in _WS:
            name.append(c)
            c = yield
        if c != "{" or not self._valid_name("".join(name)):
            raise NotACall
        self._begin("".join(name))
        try:
            body, c = yield from self._until(c, CLOSE)
        except EndOfText:
            self._end()
            return None
        try:
            self._args(gemma4_to_json(body))
        except ValueError:
            pass
        self._end()
        return c


FORMAT = ChatToolFormat("gemma4", Gemma4ToolParser, TOOL_CALL_FORMATS["gemma4"], is_gemma4_template,
                        think_tags=(THOUGHT_OPEN, THOUGHT_CLOSE))
