"""DeepSeek V3.2 and V4 tool calls in DSML markup, as llama.cpp reads them (``common/parsers/deepseek.cpp``)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

V4 names the block ``tool_calls`` instead of ``function_calls``. A parameter written ``string="true"`` is the text
between its tags, taken as it stands; ``string="false"`` is JSON (text that does not parse stays a string), as the
templates write them (strings raw, anything else ``tojson``). The model reasons in ``<think>``: the prompt opens the
block when thinking is on (``thinking``/``enable_thinking``) and closes it otherwise (V3.2 ``<think></think>``, V4 a
bare ``</think>``), and the reasoning also ends where a call block begins (llama.cpp's end tags). The templates render
the tools and the earlier calls and results themselves; for V4, a run of tool results goes to the template in the
order of the calls it answers, as llama.cpp orders them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpullama.chat.formats.base import ChatToolFormat, template_messages
from gpullama.chat.formats.tagged import TaggedToolParser, typed_value
from gpullama.chat.tool_calls import EndOfText, NotACall, Scan, _Bad
from gpullama.structured.tools import TOOL_CALL_FORMATS

DSML = "｜DSML｜"
BLOCKS = ("function_calls", "tool_calls")  # V3.2's block, V4's
CALLS_OPEN = {f"<{DSML}{b}>": f"</{DSML}{b}>" for b in BLOCKS}  # each block's open tag and its close tag
INVOKE, INVOKE_CLOSE = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAMETER, PARAMETER_CLOSE = f"<{DSML}parameter", f"</{DSML}parameter>"


def is_dsml_template(source: str) -> bool:
    """Whether a chat template writes DSML calls (llama.cpp's test: ``dsml_token``, ``DSML`` and a
    ``function_calls`` or ``tool_calls`` block in its source)."""
    return "dsml_token" in source and "DSML" in source and ("function_calls" in source or "tool_calls" in source)


def is_v3_2_template(source: str) -> bool:
    """A DSML template whose call block is V3.2's ``function_calls``."""
    return is_dsml_template(source) and "function_calls" in source


def is_v4_template(source: str) -> bool:
    """A DSML template whose call block is V4's ``tool_calls`` (llama.cpp: no ``function_calls`` in the source)."""
    return is_dsml_template(source) and "function_calls" not in source


def dsml_value(text: str, string: bool) -> str:
    """The JSON text of a parameter's value: `text` as a JSON string when the model marked it ``string="true"``,
    else the text itself when it is JSON (Python's True, False and None read as JSON's), else a string."""
    return json.dumps(text, ensure_ascii=False) if string else typed_value(text, {})


class DsmlToolParser(TaggedToolParser):
    """A ``<｜DSML｜function_calls>`` (or V4's ``<｜DSML｜tool_calls>``) block of ``<｜DSML｜invoke name="NAME">``
    calls, each holding ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`` tags;
    committed once the first name is read (an unknown name stays content), each parameter streamed once its value
    is read. Whitespace between the tags is free."""

    name = "deepseek_v3_2"
    markers = tuple(CALLS_OPEN)
    token_markers = (DSML,)

    def _region_scan(self) -> Scan:
        close = CALLS_OPEN[self._trigger]
        c = yield from self._skip_ws((yield))
        try:
            c = yield from self._literal(c, INVOKE)
            name, c = yield from self._invoke_name(c)
        except (_Bad, EndOfText):
            raise NotACall from None
        while True:
            self._open_call(name)
            try:
                c = yield from self._parameters(c)
            except EndOfText:
                self._close_call()
                return None
            self._close_call()
            c = yield from self._skip_ws(c)
            self._set_mark()  # anything but the next invoke or the block's close goes back to the content
            try:
                tag, c = yield from self._one_of(c, (INVOKE, close))
                if tag == close:
                    return c
                name, c = yield from self._invoke_name(c)
            except EndOfText:
                return None
            except _Bad:
                raise NotACall from None

    def _invoke_name(self, c: Any) -> Scan:
        """`` name="NAME">`` of an invoke (NotACall for a name the offered tools lack); return (NAME, the
        character after it)."""
        name, c = yield from self._attribute(c, "name")
        c = yield from self._literal(c, ">")
        if not self._valid_name(name):
            raise NotACall
        return name, c

    def _parameters(self, c: Any) -> Scan:
        """The open call's parameters through ``</｜DSML｜invoke>``; return the character after it. A malformed tag
        closes the call and goes back to the content."""
        while True:
            c = yield from self._skip_ws(c)
            self._set_mark()
            try:
                tag, c = yield from self._one_of(c, (PARAMETER, INVOKE_CLOSE))
                if tag == INVOKE_CLOSE:
                    return c
                key, c = yield from self._attribute(c, "name")
                string, c = yield from self._attribute(c, "string")
                c = yield from self._literal((yield from self._skip_ws(c)), ">")
            except _Bad:
                self._close_call()
                raise NotACall from None
            value, c = yield from self._until(c, PARAMETER_CLOSE)
            self._typed_argument(key, value, string == "true")

    def _attribute(self, c: Any, key: str) -> Scan:
        """`` key="VALUE"`` (whitespace before it) starting at `c`; return (VALUE, the character after it)."""
        c = yield from self._skip_ws(c)
        c = yield from self._literal(c, f'{key}="')
        return (yield from self._until(c, '"'))

    def _typed_argument(self, key: str, text: str, string: bool) -> None:
        """One parameter of the open call, typed by its ``string`` attribute (`dsml_value`)."""
        self._args(("{" if self._arg_count == 0 else ",") + json.dumps(key, ensure_ascii=False) + ":"
                   + dsml_value(text, string))
        self._arg_count += 1


class DsmlV4ToolParser(DsmlToolParser):
    """`DsmlToolParser` under V4's name (it reads either block)."""

    name = "deepseek_v4"


def v4_messages(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None, tool_choice: Any,
                parallel_tool_calls: bool) -> list[dict[str, Any]]:
    """`template_messages`, each run of user and tool messages after an assistant's calls with its tool results
    in the order of the calls they answer (by ``tool_call_id``; llama.cpp's ``deepseek_v4_sort_tool_results``,
    after DeepSeek's reference, which renders one user block of results in call order)."""
    out = template_messages(messages)
    order: dict[str, int] = {}
    i = 0
    while i < len(out):
        role = out[i].get("role")
        calls = out[i].get("tool_calls")
        if role == "assistant" and isinstance(calls, list) and calls:
            order = {c["id"]: k for k, c in enumerate(calls) if isinstance(c.get("id"), str) and c["id"]}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        while end < len(out) and out[end].get("role") in ("user", "tool"):
            end += 1
        places = [k for k in range(i, end) if out[k].get("role") == "tool"]
        if len(places) > 1 and order:
            results = sorted((out[k] for k in places), key=lambda m: order.get(m.get("tool_call_id") or "", 0))
            for k, message in zip(places, results):
                out[k] = message
        i = end
    return out


REASONING_ENDS = tuple(CALLS_OPEN)
V3_2 = ChatToolFormat("deepseek_v3_2", DsmlToolParser, TOOL_CALL_FORMATS["deepseek_v3_2"], is_v3_2_template,
                      reasoning_ends=REASONING_ENDS)
V4 = ChatToolFormat("deepseek_v4", DsmlV4ToolParser, TOOL_CALL_FORMATS["deepseek_v4"], is_v4_template,
                    prompt_messages=v4_messages, reasoning_ends=REASONING_ENDS)
