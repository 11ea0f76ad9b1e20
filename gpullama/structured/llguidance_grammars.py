"""Specs as llguidance grammars (Lark text): compact, strict JSON schemas, choices, GBNF, regexes and tool calls.

Every JSON grammar is compact (one space after ``,`` and ``:``, no other whitespace) through llguidance's JSON
options (``x-guidance``), and strict (OpenAI strict mode: no property the schema does not name) through
`strict_schema`, which adds ``additionalProperties: false`` where a schema leaves it open.

Every grammar starts with `HEADER`: llguidance's ``no_forcing``. By default llguidance tokenizes the text a
grammar forces (``{"name": "f", "arguments": ``) with the model's tokenizer and allows only that tokenization;
without forcing, as with xgrammar, every token that spells allowed text is allowed, and llguidance never calls
back into Python for a tokenization while it fills masks.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from gpullama.structured.spec import StructuredOutputError, ToolCallGrammar
from gpullama.structured.tools import (
    TOOL_CALL_FORMATS,
    GemmaToolCallFormat,
    TaggedToolCallFormat,
    may_be_string,
    schema_properties,
    value_types,
)

HEADER = '%llguidance {"no_forcing": true}\n'

# llguidance's JSON compile options: compact separators, no free whitespace, and keywords it does not implement
# (`not`, `if`, unknown formats, ...) ignored rather than refused, as xgrammar did; `oneOf` is read as `anyOf`.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (draft 2020-12 and older).
_SCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
           "contains", "propertyNames", "not", "if", "then", "else")
_SCHEMA_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OBJECT_KEYS = ("properties", "patternProperties", "required", "minProperties", "maxProperties")


def _is_object_schema(node: dict) -> bool:
    kind = node.get("type")
    if kind is not None:
        return kind == "object" or (isinstance(kind, list) and "object" in kind)
    return any(k in node for k in _OBJECT_KEYS)


def _strict(node: Any, in_all_of: bool) -> Any:
    if isinstance(node, list):
        return [_strict(n, False) for n in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key], False)
    for key in _SCHEMA_LIST:
        if isinstance(out.get(key), list):
            out[key] = _strict(out[key], False)
    for key in _SCHEMA_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(sub, False) for name, sub in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_strict(sub, True) for sub in out["allOf"]]
    # allOf branches and their parent stay open: llguidance intersects them, and a closed branch would refuse the
    # properties the other branches name.
    if not in_all_of and "allOf" not in out and _is_object_schema(out) and "additionalProperties" not in out:
        out["additionalProperties"] = out.get("unevaluatedProperties", False)
    if "prefixItems" in out and "items" not in out:
        out["items"] = False
    return out


def strict_schema(schema: dict) -> dict:
    """A copy of `schema` in OpenAI strict mode, as xgrammar's ``strict_mode`` read it: every object schema
    without ``additionalProperties`` gets ``false`` (or its ``unevaluatedProperties``), every array with
    ``prefixItems`` and no ``items`` gets ``items: false``. Schemas under ``allOf`` are left open (see above)."""
    return _strict(copy.deepcopy(schema), False)


def json_schema_grammar(schema: dict | bool, strict: bool = True) -> dict:
    """The schema llguidance compiles for `schema`: strict (unless `strict` is False) and compact
    (``x-guidance`` options at its top level, where llguidance reads them)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object or true")
    out = strict_schema(schema) if strict else dict(schema)
    out["x-guidance"] = dict(JSON_OPTIONS)
    return out


def json_lark(schema: dict | bool, strict: bool = True) -> str:
    """A Lark grammar of one JSON value valid against `schema` (compact; strict unless `strict` is False)."""
    return HEADER + "start: %json " + json.dumps(json_schema_grammar(schema, strict), ensure_ascii=False)


def regex_lark(regex: str) -> str:
    r"""A Lark grammar of text matching `regex` in full (``\d`` and ``\w`` ASCII, as in JSON schema patterns)."""
    import llguidance

    return HEADER + f"start: /{llguidance.regex_to_lark(regex, 'dw')}/"


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def regex_escape(text: str) -> str:
    r"""`text` as a literal for llguidance's regexes (Rust `regex` syntax): ASCII punctuation as ``\xHH``, which
    also keeps ``/`` from ending a Lark ``/.../``."""
    return "".join(c if c.isalnum() or ord(c) > 0x7F else f"\\x{ord(c):02X}" for c in text)


def choice_lark(choices: tuple[str, ...]) -> str:
    """A Lark grammar of exactly one of `choices`."""
    return HEADER + "start: " + " | ".join(lark_string(c) for c in choices)


def gbnf_lark(grammar: str) -> str:
    """The Lark text of a GBNF/EBNF grammar (start rule ``root``); Lark text (a ``start:`` rule) is kept.
    ValueError with the converter's reason if it cannot be converted."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return HEADER + any_to_lark(grammar)
    except Exception as e:  # noqa: BLE001 - the converter raises bare Exceptions
        raise ValueError(str(e)) from None


def tool_calls_lark(spec: ToolCallGrammar) -> str:
    """A Lark grammar of `spec`'s calls in its format, each call's arguments a compact, strict JSON value of its
    tool's parameters schema."""
    fmt = TOOL_CALL_FORMATS[spec.format]
    rules = []
    calls = []
    for i, (name, schema) in enumerate(spec.tools):
        if isinstance(fmt, TaggedToolCallFormat):
            rules += _tagged_call_rules(fmt, i, name, json.loads(schema))
        elif isinstance(fmt, GemmaToolCallFormat):
            rules += _gemma_call_rules(fmt, i, name, json.loads(schema))
        else:
            body = json.dumps(json_schema_grammar(json.loads(schema)), ensure_ascii=False)
            rules.append(f"call_{i}: {lark_string(fmt.call_prefix(name))} %json {body} "
                         f"{lark_string(fmt.call_suffix())}")
        calls.append(f"call_{i}")
    rules.append("one: " + " | ".join(calls))

    def seq(*parts: str) -> str:
        return " ".join(p for p in parts if p) or '""'

    def lit(text: str | None) -> str:
        return lark_string(text) if text else ""

    many = seq("one", f"({lit(fmt.sep)} one)*" if fmt.sep else "one*") if spec.parallel else "one"
    body = seq(lit(fmt.open), many, lit(fmt.close))
    if fmt.single_open is not None:
        single = seq(lit(fmt.single_open), "one", lit(fmt.single_close))
        body = f"{single} | {body}" if spec.parallel else single
    return HEADER + "\n".join([f"start: {body}", *rules])


def _raw_value(fmt: TaggedToolCallFormat, schema: dict, rule: str) -> list[str]:
    """Rules of an argument whose value is a raw string, its close tag included: one of the schema's strings
    (``enum``/``const``), else text of ``minLength`` to ``maxLength`` characters that never holds the close tag
    (other string keywords, such as ``pattern``, are not enforced)."""
    close = fmt.arg_close
    if isinstance(schema, dict) and ("const" in schema or "enum" in schema):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        texts = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values]
        return [f"{rule}: " + " | ".join(lark_string(t + close) for t in texts)]
    core = close.rstrip()  # the tag itself: the value never holds it
    strings = isinstance(schema, dict) and value_types(schema) == {"string"}  # lengths bound strings only
    low = schema.get("minLength", 0) if strings else 0
    high = schema.get("maxLength", "") if strings else ""
    text, tag = "(.|\\n)", regex_escape(core)
    terminal = rule.upper()
    return [f"{rule}: {terminal}",
            f"{terminal}: /{text}{{{low},{high}}}{tag}{regex_escape(close[len(core):])}/ & "
            f"~/{text}*{tag}{text}*{tag}{text}*/"]


def _tagged_call_rules(fmt: TaggedToolCallFormat, index: int, name: str, schema: dict) -> list[str]:
    """Rules of one call in a tagged format: its required arguments in the schema's order, then each optional
    one or not; each value raw (schemas that allow a string, as llama.cpp's grammars) or compact, strict JSON."""
    rules, parts = [], []
    for j, (key, sub, required) in enumerate(schema_properties(schema)):
        rule = f"call_{index}_arg_{j}"
        head = lark_string(fmt.arg_prefix(key, may_be_string(sub)))
        if may_be_string(sub):
            rules += _raw_value(fmt, sub, f"{rule}_value")
            rules.append(f"{rule}: {head} {rule}_value")
        else:
            body = json.dumps(json_schema_grammar(sub if isinstance(sub, dict) else {}), ensure_ascii=False)
            rules.append(f"{rule}: {head} %json {body} {lark_string(fmt.arg_close)}")
        parts.append(rule if required else f"{rule}?")
    rules.append(f"call_{index}: {lark_string(fmt.call_prefix(name))} {' '.join(parts)} "
                 f"{lark_string(fmt.call_suffix())}")
    return rules


_GEMMA_ANY = [  # any value in Gemma's object syntax (a schema this grammar does not follow)
    "gemma_any: gemma_str | gemma_obj | gemma_arr | %json {\"type\": [\"number\", \"boolean\", \"null\"]}",
    "gemma_obj: \"{\" (gemma_kv (\",\" gemma_kv)*)? \"}\"",
    "gemma_kv: GEMMA_KEY \":\" gemma_any",
    "GEMMA_KEY: /[A-Za-z_][A-Za-z0-9_\\-]*/",
    "gemma_arr: \"[\" (gemma_any (\",\" gemma_any)*)? \"]\"",
]


def _gemma_string(fmt: GemmaToolCallFormat, schema: Any, rule: str) -> list[str]:
    """A quoted string value, its closing quote included in the lexeme: the schema's length bounds kept."""
    quote = regex_escape(fmt.quote)
    low = schema.get("minLength", 0) if isinstance(schema, dict) else 0
    high = schema.get("maxLength", "") if isinstance(schema, dict) else ""
    text, terminal = "(.|\\n)", rule.upper()
    return [f"{rule}: {lark_string(fmt.quote)} {terminal}",
            f"{terminal}: /{text}{{{low},{high}}}{quote}/ & ~/{text}*{quote}{text}*{quote}{text}*/"]


def _gemma_value(fmt: GemmaToolCallFormat, schema: Any, rule: str) -> list[str]:
    """Rules for `rule`: a value of `schema` in Gemma's object syntax."""
    if not isinstance(schema, dict):
        return [f"{rule}: gemma_any"]
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return [f"{rule}: " + " | ".join(lark_string(fmt.value_text(v)) for v in values)]
    types = value_types(schema)
    if types == {"string"}:
        return _gemma_string(fmt, schema, rule)
    if types == {"object"} and isinstance(schema.get("properties"), dict):
        return _gemma_object(fmt, schema, rule)
    if types == {"array"} and isinstance(schema.get("items"), dict):
        item = f"{rule}_item"
        return [*_gemma_value(fmt, schema["items"], item), f"{rule}: \"[\" ({item} (\",\" {item})*)? \"]\""]
    if types <= {"integer", "number", "boolean", "null"}:
        return [f"{rule}: %json {json.dumps(json_schema_grammar(schema), ensure_ascii=False)}"]
    return [f"{rule}: gemma_any"]


def _gemma_object(fmt: GemmaToolCallFormat, schema: dict, rule: str) -> list[str]:
    """An object of `schema`'s properties: the required ones in order, then each optional one or not."""
    props = schema_properties(schema)
    props = [p for p in props if p[2]] + [p for p in props if not p[2]]
    rules, parts = [], []
    for j, (key, sub, required) in enumerate(props):
        value = f"{rule}_{j}"
        rules += _gemma_value(fmt, sub, value)
        item = f"{lark_string(key + ':')} {value}"
        if not parts:
            parts.append(item if required else f"({item}")
        else:
            parts.append(f"\",\" {item}" if required else f"(\",\" {item})?")
    if parts and not props[0][2]:  # nothing required: the first optional one opens the rest, or none at all
        parts[-1] += ")?"
    return [*rules, f"{rule}: \"{{\" {' '.join(parts)} \"}}\""]


def _gemma_call_rules(fmt: GemmaToolCallFormat, index: int, name: str, schema: dict) -> list[str]:
    """Rules of one Gemma 4 call: its arguments an object of the parameters schema in Gemma's syntax."""
    args = f"call_{index}_args"
    schema = schema if schema.get("properties") else {**schema, "properties": {}}
    rules = _gemma_object(fmt, schema, args)
    if index == 0:  # the rules of any value, once
        rules += [*_GEMMA_ANY, *_gemma_string(fmt, {}, "gemma_str")]
    return [*rules, f"call_{index}: {lark_string(fmt.call_prefix(name))} {args} {lark_string(fmt.call_suffix())}"]


def reason(message: str) -> str:
    """llguidance's error message on one line: without its position prefix and the grammar excerpt it quotes."""
    lines = []
    for line in message.strip().splitlines():
        if re.match(r"^\s*\d+ \| ", line) or re.match(r"^\s*\^+\s*$", line) or line.startswith("<state>"):
            if line.startswith("<state>"):
                break
            continue
        lines.append(line.strip())
    text = " ".join(x for x in lines if x)
    return re.sub(r"^(at \d+\(\d+\): |failed to compile JSON schema: )", "", text)


def check(grammar: str, param: str, what: str) -> None:
    """StructuredOutputError naming `param` unless llguidance accepts `grammar` (checked without a vocabulary)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise StructuredOutputError(f"{param}: invalid {what}: {reason(error)}", param)
