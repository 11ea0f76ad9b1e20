"""GLM-4.5 / 4.6 / 4.7 tool calls (llama.cpp reads them with its generic tagged-arguments parser), one
``<tool_call>`` block per call, the name first, then one ``<arg_key>``/``<arg_value>`` pair per argument::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7's template writes the same without the newlines.) A value is the text between its tags; it is a string
when the tool's schema allows one, else JSON (`gpullama.chat.formats.tagged.typed_value` with ``strings_win``).
The model reasons in ``<think>`` (GLM-4.7's prompt opens the block); the template renders the tools itself."""

from __future__ import annotations

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.formats.tagged import TaggedToolParser
from gpullama.chat.tool_calls import NAME_CHARS, EndOfText, NotACall, Scan, _Bad
from gpullama.structured.tools import TOOL_CALL_FORMATS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_CLOSE, VALUE, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def is_glm45_template(source: str) -> bool:
    """Whether a chat template writes GLM-4.5's calls: ``<tool_call>`` with ``<arg_key>``/``<arg_value>`` pairs
    (Ling 3's ``<role>`` sections, which llama.cpp reads with its own parser, excepted)."""
    return OPEN in source and KEY in source and VALUE in source and "<role>ASSISTANT</role>" not in source


class Glm45ToolParser(TaggedToolParser):
    """``<tool_call>NAME`` then ``<arg_key>``/``<arg_value>`` pairs, then ``</tool_call>``; committed once the
    name is read (an unknown name stays content). Whitespace between the tags is free."""

    name = "glm45"
    markers = (OPEN,)
    token_markers = (OPEN, CLOSE)
    strings_win = True

    def _region_scan(self) -> Scan:
        c = yield from self._skip_ws((yield))
        name = []
        while c is not None and c in NAME_CHARS:
            name.append(c)
            c = yield
        c = yield from self._skip_ws(c)
        if c not in ("<", None) or not self._valid_name("".join(name)):
            raise NotACall
        self._open_call("".join(name))
        try:
            while True:
                c = yield from self._skip_ws(c)
                tag, c = yield from self._one_of(c, (KEY, CLOSE))
                if tag == CLOSE:
                    break
                key, c = yield from self._until(c, KEY_CLOSE)
                c = yield from self._skip_ws(c)
                c = yield from self._literal(c, VALUE)
                value, c = yield from self._until(c, VALUE_CLOSE)
                self._argument(key.strip(), value)
        except EndOfText:
            c = None
        except _Bad:
            pass
        self._close_call()
        return c


FORMAT = ChatToolFormat("glm45", Glm45ToolParser, TOOL_CALL_FORMATS["glm45"], is_glm45_template)
