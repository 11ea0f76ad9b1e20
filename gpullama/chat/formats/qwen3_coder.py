"""Qwen3-Coder / Qwen3.5 XML tool calls (llama.cpp's qwen3-coder parser), one ``<tool_call>`` block per call::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are typed by the tool's parameters schema (`gpullama.chat.formats.tagged.typed_value`). Qwen3.5's template
reasons in ``<think>``, and its reasoning also ends where a ``<tool_call>`` begins (llama.cpp's end tags); the
template renders the tools itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpullama.chat.formats.base import ChatToolFormat
from gpullama.chat.formats.tagged import TaggedToolParser
from gpullama.chat.output import ChatOutputParser
from gpullama.chat.reasoning import ReasoningParser
from gpullama.chat.tool_calls import EndOfText, NotACall, Scan, _Bad
from gpullama.structured.tools import TOOL_CALL_FORMATS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER, PARAMETER_CLOSE = "<parameter=", "</parameter>"


def is_qwen3_coder_template(source: str) -> bool:
    """Whether a chat template writes Qwen3-Coder's XML calls (llama.cpp's test: ``<tool_call>``, ``<function=``
    and ``<parameter=``, with the newline after ``<tool_call>``)."""
    return (OPEN in source and FUNCTION in source and PARAMETER in source
            and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in source)


class Qwen3CoderToolParser(TaggedToolParser):
    """``<tool_call>`` blocks holding ``<function=NAME>`` and its ``<parameter=KEY>`` tags; committed once the
    name is read (an unknown name, or anything but ``<function=`` after the open tag, stays content). A value
    runs to ``</parameter>``, without the newline on either side of it. With `bare_functions` (Qwen3-Coder, whose
    template does not reason) a whole ``<function=NAME>`` of an offered tool also opens a call without the
    ``<tool_call>`` tag, as in llama.cpp, which Qwen3-Coder sometimes leaves out."""

    name = "qwen3_coder"
    markers = (OPEN,)
    token_markers = (OPEN, CLOSE)

    def __init__(self, tool_names: Iterable[str] | None = None, *args: Any, bare_functions: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(tool_names, *args, **kwargs)
        if bare_functions and self.tool_names:
            self.markers = (OPEN, *(f"{FUNCTION}{name}>" for name in sorted(self.tool_names)))

    def _region_scan(self) -> Scan:
        if self._trigger == OPEN:
            c = yield from self._skip_ws((yield))
            try:
                c = yield from self._literal(c, FUNCTION)
            except (_Bad, EndOfText):
                raise NotACall from None
            name, c = yield from self._name(c, ">")
        else:  # a bare <function=NAME> of an offered tool
            name, c = self._trigger[len(FUNCTION):-1], (yield)
        self._open_call(name)
        try:
            while True:
                c = yield from self._skip_ws(c)
                tag, c = yield from self._one_of(c, (PARAMETER, FUNCTION_CLOSE, CLOSE))
                if tag == CLOSE:
                    break
                if tag == FUNCTION_CLOSE:
                    self._close_call()
                    c = yield from self._skip_ws(c)
                    if c != "<":
                        return c
                    self._set_mark()  # anything but </tool_call> here goes back to the content
                    try:
                        return (yield from self._literal(c, CLOSE))
                    except _Bad:
                        raise NotACall from None
                key, c = yield from self._until(c, ">")
                value, c = yield from self._until(c, PARAMETER_CLOSE)
                value = value[1:] if value.startswith("\n") else value
                self._argument(key.strip(), value[:-1] if value.endswith("\n") else value)
        except EndOfText:
            c = None
        except _Bad:
            pass
        self._close_call()
        return c


def _output(fmt: ChatToolFormat, tool_names: Iterable[str] | None, reasoning: ReasoningParser | None) -> Any:
    """The answer's reader: reasoning (Qwen3.5's also ends at a ``<tool_call>``), then the calls; a model that does
    not reason (Qwen3-Coder) may also open a call with a bare ``<function=NAME>``."""
    if reasoning is not None:
        reasoning.end_markers = fmt.reasoning_ends
    tools = None if tool_names is None else Qwen3CoderToolParser(tool_names, bare_functions=reasoning is None)
    return ChatOutputParser(reasoning, tools)


FORMAT = ChatToolFormat("qwen3_coder", Qwen3CoderToolParser, TOOL_CALL_FORMATS["qwen3_coder"],
                        is_qwen3_coder_template, reasoning_ends=(OPEN,), output=_output)
