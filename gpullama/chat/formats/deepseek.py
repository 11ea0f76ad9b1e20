"""DeepSeek V3.1 and R1 tool calls, as llama.cpp reads them: one ``<｜tool▁calls▁begin｜>`` block of calls, each::

    <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>            (V3.1)
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>                                                                  (R1)

then ``<｜tool▁calls▁end｜>``. The model reasons in ``<think>`` (the V3.1 template closes the block in the prompt
unless ``thinking``/``enable_thinking`` is on; R1's opens it). The templates render earlier calls themselves, but
V3.1's and the R1 distills' do not describe the offered tools (llama.cpp renders them so too, with a warning);
llama.cpp's ``llama-cpp-deepseek-r1.jinja`` does. DeepSeek V3.2 / V4's DSML markup is another format, not this one.
"""

from __future__ import annotations

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.tool_calls import NAME_CHARS, EndOfText, NotACall, Scan, ToolParser, _Bad
from gpullama.structured.tools import TOOL_CALL_FORMATS

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


def is_deepseek_template(source: str) -> bool:
    """Whether a chat template writes DeepSeek V3.1 / R1 calls (``<｜tool▁calls▁begin｜>``; V3.2's DSML excepted)."""
    return CALLS_BEGIN in source and "dsml_token" not in source


class DeepSeekToolParser(ToolParser):
    """A ``<｜tool▁calls▁begin｜>`` block (or a lone ``<｜tool▁call▁begin｜>``) of calls, V3.1's or R1's; a
    call is committed once its name is read (an unknown name stays content), its arguments stream as written."""

    name = "deepseek"
    markers = (CALLS_BEGIN, CALL_BEGIN)
    token_markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def _region_scan(self) -> Scan:
        c = yield
        if self._trigger == CALLS_BEGIN:
            c = yield from self._skip_ws(c)
            try:
                c = yield from self._literal(c, CALL_BEGIN)
            except (_Bad, EndOfText):
                raise NotACall from None
        first = True
        while True:
            try:
                c = yield from self._one_call(c, first)
                c = yield from self._skip_ws(c)
                c = yield from self._literal(c, CALL_END)
                c = yield from self._skip_ws(c)
                tag, c = yield from self._one_of(c, (CALL_BEGIN, CALLS_END))
            except EndOfText:
                self._end()
                return None
            except _Bad:
                self._end()
                return c
            first = False
            if tag == CALLS_END:
                return c

    def _one_call(self, c, first: bool) -> Scan:
        """A call from its name (`c` the first character after ``<｜tool▁call▁begin｜>``) through its arguments."""
        head = []
        while c is not None and c in NAME_CHARS:
            head.append(c)
            c = yield
        r1 = "".join(head) == "function"
        name: list[str] = []
        try:
            c = yield from self._literal(c, SEP)
            if r1:  # R1: "function<｜tool▁sep｜>NAME\n```json\n{...}\n```"
                while c is not None and c in NAME_CHARS:
                    name.append(c)
                    c = yield
                c = yield from self._skip_ws(c)
                if c == "`":
                    c = yield from self._literal(c, FENCE)
                    while c is not None and c.isalpha():
                        c = yield
            else:
                name = head
        except (_Bad, EndOfText):
            if first:
                raise NotACall from None
            raise
        if not self._valid_name("".join(name)):
            if first:
                raise NotACall
            raise _Bad
        self._begin("".join(name))
        c = yield from self._skip_ws(c)
        if c is None:
            raise EndOfText
        c = yield from self._arguments(c, self._args)
        self._end()
        if r1:
            c = yield from self._skip_ws(c)
            if c == "`":
                c = yield from self._literal(c, FENCE)
        return c


FORMAT = ChatToolFormat("deepseek", DeepSeekToolParser, TOOL_CALL_FORMATS["deepseek"], is_deepseek_template)
