"""Tool-call grammars: the text each model family writes for a call, and the spec forcing such calls."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpullama.structured.spec import (
    StructuredOutput,
    StructuredOutputError,
    ToolCallGrammar,
    canonical_json,
    check_json_schema,
)

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes calls: ``open + call (sep call)* + close``, each call
    ``call_open + {"name": NAME, "<args_key>": ARGS} + call_close``. `single` is the form of exactly one call
    when it differs (the generic format's lone object without the array brackets)."""

    name: str
    args_key: str
    call_open: str = ""
    call_close: str = ""
    sep: str = ""
    open: str = ""
    close: str = ""
    single_open: str | None = None
    single_close: str | None = None

    def call_prefix(self, function: str) -> str:
        """Text of a call up to its arguments."""
        return f'{self.call_open}{{"name": {json.dumps(function, ensure_ascii=False)}, "{self.args_key}": '

    def call_suffix(self) -> str:
        """Text of a call after its arguments."""
        return "}" + self.call_close

    def render(self, calls: Sequence[tuple[str, Any]], parallel: bool | None = None) -> str:
        """The text of `calls` ((name, arguments object) pairs) in this format, as the grammar writes it."""
        body = [self.call_prefix(n) + json.dumps(a, ensure_ascii=False) + self.call_suffix() for n, a in calls]
        single = len(calls) == 1 and not parallel and self.single_open is not None
        if single:
            return self.single_open + body[0] + self.single_close
        return self.open + self.sep.join(body) + self.close


JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {str: "string", float: "number", dict: "object", list: "array"}.get(type(value), "null")


def value_types(schema: Any) -> frozenset[str]:
    """The JSON types a value of `schema` may have (``type``, else ``const``/``enum`` values, else the union of
    ``anyOf``/``oneOf``; every type when the schema does not say), as llama.cpp types tagged arguments."""
    if not isinstance(schema, dict):
        return JSON_TYPES
    kind = schema.get("type")
    if isinstance(kind, str):
        return frozenset({kind}) & JSON_TYPES or JSON_TYPES
    if isinstance(kind, list):
        return frozenset(k for k in kind if k in JSON_TYPES) or JSON_TYPES
    if "const" in schema:
        return frozenset({_json_type(schema["const"])})
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return frozenset(_json_type(v) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return frozenset().union(*(value_types(s) for s in schema[key]))
    return JSON_TYPES


def may_be_string(schema: Any) -> bool:
    """Whether a value of `schema` may be a string: a tagged format's grammar writes it raw, not as JSON (the raw
    text also spells the other types a parser reads first, as in llama.cpp's grammars)."""
    return "string" in value_types(schema)


def schema_properties(schema: Any) -> list[tuple[str, Any, bool]]:
    """(name, schema, required) of each property a parameters schema names, in its order."""
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        return []
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    return [(name, sub, name in required) for name, sub in schema["properties"].items()]


@dataclass(frozen=True)
class NamedToolCallFormat(ToolCallFormat):
    """Calls whose function name stands in the text before a JSON arguments object (DeepSeek's): `call_open`
    with the name for ``{name}``, the arguments, then `call_close`."""

    def call_prefix(self, function: str) -> str:
        """Text of a call up to its arguments."""
        return self.call_open.replace("{name}", function)

    def call_suffix(self) -> str:
        """Text of a call after its arguments."""
        return self.call_close


@dataclass(frozen=True)
class GemmaToolCallFormat(NamedToolCallFormat):
    """Gemma 4's calls: `call_open` with the name for ``{name}``, the arguments in Gemma's object syntax (bare
    keys, strings between `quote` marks, other scalars as JSON), `call_close`. The grammar writes an object's
    required properties in the schema's order, then its optional ones in theirs (each only after the one before
    it when none is required)."""

    quote: str = '<|"|>'

    def value_text(self, value: Any) -> str:
        """`value` in Gemma's object syntax."""
        if isinstance(value, str):
            return self.quote + value + self.quote
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{self.value_text(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ",".join(self.value_text(v) for v in value) + "]"
        return json.dumps(value)

    def render(self, calls: Sequence[tuple[str, Any]], parallel: bool | None = None) -> str:
        """The text of `calls` ((name, arguments object) pairs) in this format, as the grammar writes it."""
        body = [self.call_prefix(n) + self.value_text(a) + self.call_suffix() for n, a in calls]
        return self.open + self.sep.join(body) + self.close


@dataclass(frozen=True)
class TaggedToolCallFormat(ToolCallFormat):
    """Calls written as tags, one per argument (Qwen3-Coder's XML, GLM-4.5's ``<arg_key>``/``<arg_value>``):
    `call_open` with the function's name for ``{name}``, then each argument as `arg_open` (its key for ``{key}``,
    and for ``{string}`` whether the value is written raw: ``true`` or ``false``, DeepSeek's DSML), the value,
    `arg_close`; then `call_close`. A string value is written raw, any other as JSON (llama.cpp's typing). The
    grammar writes the required arguments in the schema's order, then any of the optional ones in theirs."""

    arg_open: str = ""
    arg_close: str = ""

    def call_prefix(self, function: str) -> str:
        """Text of a call up to its first argument."""
        return self.call_open.replace("{name}", function)

    def call_suffix(self) -> str:
        """Text of a call after its last argument."""
        return self.call_close

    def arg_prefix(self, key: str, raw: bool = True) -> str:
        """Text of an argument up to its value (`raw`: the value is written as text, not JSON)."""
        return self.arg_open.replace("{key}", key).replace("{string}", "true" if raw else "false")

    def render(self, calls: Sequence[tuple[str, Any]], parallel: bool | None = None) -> str:
        """The text of `calls` ((name, arguments object) pairs) in this format, as the grammar writes it."""
        body = []
        for name, args in calls:
            text = [self.call_prefix(name)]
            for key, value in args.items():
                raw = isinstance(value, str)
                text += [self.arg_prefix(key, raw), value if raw else json.dumps(value, ensure_ascii=False),
                         self.arg_close]
            body.append("".join(text) + self.call_suffix())
        return self.open + self.sep.join(body) + self.close


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    # what the generic system prompt asks for: one object, or an array of them for several calls
    "generic": ToolCallFormat("generic", "arguments", sep=", ", open="[", close="]", single_open="",
                              single_close=""),
    # Qwen2.5 / Qwen3 / Hermes 2 Pro
    "hermes": ToolCallFormat("hermes", "arguments", call_open="<tool_call>\n", call_close="\n</tool_call>",
                             sep="\n"),
    # Llama 3.1 / 3.2 JSON tool calling (no <|python_tag|>: that token is a control token)
    "llama3": ToolCallFormat("llama3", "parameters", sep="; "),
    # Mistral v3 ([TOOL_CALLS] spelled out when it is a control token)
    "mistral": ToolCallFormat("mistral", "arguments", sep=", ", open="[TOOL_CALLS][", close="]"),
    # DeepSeek V3.1 (R1's "function<｜tool▁sep｜>NAME\n```json ...```" form is read, not written)
    "deepseek": NamedToolCallFormat("deepseek", "", call_open="<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
                                    call_close="<｜tool▁call▁end｜>", open="<｜tool▁calls▁begin｜>",
                                    close="<｜tool▁calls▁end｜>"),
    # Gemma 4
    "gemma4": GemmaToolCallFormat("gemma4", "", call_open="<|tool_call>call:{name}", call_close="<tool_call|>"),
    # GLM-4.5 / 4.6 / 4.7 (<arg_key>/<arg_value> pairs)
    "glm45": TaggedToolCallFormat("glm45", "", call_open="<tool_call>{name}\n", call_close="</tool_call>", sep="\n",
                                  arg_open="<arg_key>{key}</arg_key>\n<arg_value>", arg_close="</arg_value>\n"),
    # Qwen3-Coder / Qwen3.5 XML (llama.cpp's qwen3-coder parser)
    "qwen3_coder": TaggedToolCallFormat("qwen3_coder", "", call_open="<tool_call>\n<function={name}>\n",
                                        call_close="</function>\n</tool_call>", sep="\n",
                                        arg_open="<parameter={key}>\n", arg_close="\n</parameter>\n"),
    # DeepSeek V3.2 (<｜DSML｜function_calls>) and V4 (<｜DSML｜tool_calls>): DSML invokes and typed parameters
    **{name: TaggedToolCallFormat(name, "", call_open='<｜DSML｜invoke name="{name}">\n',
                                  call_close="</｜DSML｜invoke>\n", open=f"<｜DSML｜{block}>\n",
                                  close=f"</｜DSML｜{block}>",
                                  arg_open='<｜DSML｜parameter name="{key}" string="{string}">',
                                  arg_close="</｜DSML｜parameter>\n")
       for name, block in (("deepseek_v3_2", "function_calls"), ("deepseek_v4", "tool_calls"))},
}


def parse_tool(tool: Any, index: int) -> tuple[str, dict]:
    """(name, parameters schema) of ``tools[index]``, an OpenAI tool (``{"type": "function", "function":
    {...}}``) or a bare function object; StructuredOutputError naming the field when malformed."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise StructuredOutputError(f"{where} must be an object", where)
    if "type" in tool or "function" in tool:
        if tool.get("type", "function") != "function":
            raise StructuredOutputError(f"{where}.type must be 'function', got {tool.get('type')!r}",
                                        f"{where}.type")
        fn, where = tool.get("function"), f"{where}.function"
    else:  # a bare function object
        fn = tool
    if not isinstance(fn, dict):
        raise StructuredOutputError(f"{where} must be an object", where)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise StructuredOutputError(f"{where}.name must be a non-empty string", f"{where}.name")
    params = fn.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    return name, check_json_schema(params, f"{where}.parameters")


def tool_call_grammar(tools: Sequence[Any], tool_choice: Any = "required", *, parallel_tool_calls: bool = True,
                      format: str = "generic") -> StructuredOutput | None:
    """The spec forcing calls of `tools` for an OpenAI `tool_choice`, or None when nothing is forced.

    ``"required"``: one or more calls of any tool (exactly one unless `parallel_tool_calls`); a named choice
    (``{"type": "function", "function": {"name": ...}}`` or the name) exactly one call of that tool; ``"auto"``
    and ``"none"``: None. The arguments follow each tool's ``parameters`` schema. Errors name the field at fault.
    """
    if format not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {format!r}; expected one of {sorted(TOOL_CALL_FORMATS)}")
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice in ("none", "auto"):
        return None
    if not isinstance(tools, (list, tuple)) or not tools:
        raise StructuredOutputError("tool_choice needs a non-empty tools list", "tools")
    functions = [parse_tool(t, i) for i, t in enumerate(tools)]
    names = [n for n, _ in functions]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise StructuredOutputError(f"tools has two functions named {dup!r}", "tools")
    indices = list(range(len(functions)))
    parallel = bool(parallel_tool_calls)
    if tool_choice != "required":
        wanted = tool_choice
        if isinstance(tool_choice, dict):
            fn = tool_choice.get("function")
            wanted = fn.get("name") if isinstance(fn, dict) else None
            if tool_choice.get("type", "function") != "function" or not isinstance(wanted, str):
                raise StructuredOutputError(
                    "tool_choice must be 'none', 'auto', 'required' or "
                    "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        elif not isinstance(tool_choice, str):
            raise StructuredOutputError("tool_choice must be a string or an object", "tool_choice")
        if wanted not in names:
            raise StructuredOutputError(f"tool_choice names function {wanted!r}, which is not in tools",
                                        "tool_choice")
        indices, parallel = [names.index(wanted)], False
    grammar = ToolCallGrammar(
        format=format,
        tools=tuple((functions[i][0], canonical_json(functions[i][1])) for i in indices),
        parallel=parallel,
        params=tuple(f"tools[{i}].function.parameters" for i in indices),
    )
    return StructuredOutput(tool_calls=grammar, param="tools")
