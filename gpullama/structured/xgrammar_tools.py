"""Tool-call grammars as xgrammar structural tags (each call's arguments a compact JSON-schema grammar)."""

from __future__ import annotations

from typing import Any

from gpullama.structured.spec import StructuredOutputError, ToolCallGrammar
from gpullama.structured.tools import TOOL_CALL_FORMATS


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _seq(*elements: dict) -> dict:
    parts = [e for e in elements if not (e["type"] == "const_string" and e["value"] == "")]
    return parts[0] if len(parts) == 1 else {"type": "sequence", "elements": parts}


# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as this class, which takes raw
# control characters (invalid in JSON: json.loads refuses them); the class of its other strings excludes them.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema_json: str, param: str) -> str:
    """EBNF of compact, strict JSON valid against `schema_json` (xgrammar's conversion, string fix applied)."""
    import xgrammar

    try:
        grammar = xgrammar.Grammar.from_json_schema(schema_json, any_whitespace=False, strict_mode=True)
    except RuntimeError as e:
        raise StructuredOutputError(f"{param}: invalid JSON schema: {_reason(e)}", param) from None
    return str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def _reason(error: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and (".cc:" in head or ".h:" in head) else text


def tool_calls_structural_tag(spec: ToolCallGrammar) -> dict[str, Any]:
    """The structural tag of `spec`: its calls in its format, each call's arguments following its schema."""
    fmt = TOOL_CALL_FORMATS[spec.format]
    params = spec.params or tuple(f"tools[{i}].function.parameters" for i in range(len(spec.tools)))
    calls = [
        _seq(_const(fmt.call_prefix(name)), {"type": "grammar", "grammar": json_schema_ebnf(schema, param)},
             _const(fmt.call_suffix()))
        for (name, schema), param in zip(spec.tools, params)
    ]
    one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    many = _seq(one, {"type": "star", "content": _seq(_const(fmt.sep), one)}) if spec.parallel else one
    body = _seq(_const(fmt.open), many, _const(fmt.close))
    if fmt.single_open is not None:
        single = _seq(_const(fmt.single_open), one, _const(fmt.single_close))
        body = {"type": "or", "elements": [single, body]} if spec.parallel else single
    return {"type": "structural_tag", "format": body}
