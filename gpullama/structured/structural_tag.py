"""xgrammar's structural-tag JSON format translated into an llguidance grammar (Lark, with side grammars).

Supported element types (docs/usage.md): const_string, json_schema (style "json"), grammar (ebnf or lark),
regex, sequence, or, optional, star, plus, repeat, tag (string begin and end(s)), any_text (excludes),
triggered_tags, tags_with_separator. Token-level types (token, exclude_token, any_tokens, token_triggered_tags,
token_dispatch), dispatch and the XML argument styles are refused with a StructuredOutputError, as is any other
type. JSON schemas inside are compact and strict, as everywhere in gpullama.
"""

from __future__ import annotations

import json
from typing import Any

from gpullama.structured.llguidance_grammars import (
    HEADER,
    gbnf_lark,
    json_schema_grammar,
    lark_string,
    reason,
    regex_escape,
)

_ANY = "/(?s:.*)/"
UNSUPPORTED = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch", "dispatch",
               "qwen_xml_parameter")


class StructuralTagError(ValueError):
    """A structural tag that cannot be translated; the message names the element's path."""


class _Lark:
    """Collects the rules, terminals and side grammars of one translation."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.side: list[dict] = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def rule(self, body: str, prefix: str = "r", attrs: str = "") -> str:
        name = self.name(prefix)
        self.lines.append(f"{name}{attrs}: {body}")
        return name

    def terminal(self, body: str) -> str:
        name = self.name("T").upper()
        self.lines.append(f"{name}: {body}")
        return name


def _field(node: dict, key: str, kind: type | tuple, path: str, default: Any = ...) -> Any:
    if key not in node:
        if default is ...:
            raise StructuralTagError(f"{path}: missing '{key}'")
        return default
    value = node[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise StructuralTagError(f"{path}.{key}: expected {names}, got {type(value).__name__}")
    return value


def _strings(node: dict, key: str, path: str, default: Any = ...) -> list[str]:
    value = _field(node, key, list, path, default)
    if not all(isinstance(s, str) for s in value):
        raise StructuralTagError(f"{path}.{key}: expected a list of strings")
    return value


def _text_terminal(lark: _Lark, excludes: list[str]) -> str:
    """A terminal of any text without the `excludes` substrings."""
    excludes = [e for e in excludes if e]
    if not excludes:
        return lark.terminal(_ANY)
    alternatives = "|".join(regex_escape(e) for e in excludes)
    return lark.terminal(f"{_ANY} & ~/(?s:.*)({alternatives})(?s:.*)/")


def _lit(text: str) -> str | None:
    return lark_string(text) if text else None


def _join(parts: list[str | None]) -> str:
    parts = [p for p in parts if p]
    return f"({' '.join(parts)})" if parts else "empty"


class _Translator:
    def __init__(self, check) -> None:
        self.lark = _Lark()
        self.check = check  # check(grammar, what, path): raise StructuralTagError if llguidance refuses it
        self.uses_empty = False

    def element(self, node: Any, path: str) -> str:
        """The Lark expression of one element."""
        if not isinstance(node, dict):
            raise StructuralTagError(f"{path}: expected an object, got {type(node).__name__}")
        kind = node.get("type")
        method = getattr(self, f"_{kind}", None) if isinstance(kind, str) else None
        if kind in UNSUPPORTED:
            raise StructuralTagError(f"{path}: type '{kind}' is not supported by gpullama's grammar engine")
        if method is None:
            raise StructuralTagError(f"{path}: unknown type {kind!r}")
        expr = method(node, path)
        if expr == "empty":
            self.uses_empty = True
        return expr

    def _const_string(self, node: dict, path: str) -> str:
        return _lit(_field(node, "value", str, path)) or "empty"

    def _json_schema(self, node: dict, path: str) -> str:
        style = _field(node, "style", str, path, "json")
        if style != "json":
            raise StructuralTagError(f"{path}.style: '{style}' is not supported by gpullama's grammar engine "
                                     "(only 'json')")
        if node.get("any_order") or node.get("excludes") or node.get("max_whitespace_cnt") is not None:
            raise StructuralTagError(f"{path}: any_order, excludes and max_whitespace_cnt are not supported")
        schema = _field(node, "json_schema", (dict, bool), path)
        if schema is False:
            raise StructuralTagError(f"{path}.json_schema: false matches nothing")
        text = json.dumps(json_schema_grammar(schema), ensure_ascii=False)
        self.check(json.dumps({"grammars": [{"json_schema": json.loads(text)}]}), "JSON schema", path)
        return f"%json {text}"

    def _grammar(self, node: dict, path: str) -> str:
        text = _field(node, "grammar", str, path)
        syntax = _field(node, "syntax", str, path, "ebnf")
        if syntax not in ("ebnf", "lark"):
            raise StructuralTagError(f"{path}.syntax: expected 'ebnf' or 'lark', got {syntax!r}")
        if syntax == "lark":
            text = HEADER + text
        else:
            try:
                text = gbnf_lark(text)
            except ValueError as e:
                raise StructuralTagError(f"{path}.grammar: {e}") from None
        self.check(json.dumps({"grammars": [{"lark_grammar": text}]}), "grammar", path)
        name = self.lark.name("grammar")
        self.lark.side.append({"name": name, "lark_grammar": text})
        return f"@{name}"

    def _regex(self, node: dict, path: str) -> str:
        import llguidance

        pattern = _field(node, "pattern", str, path)
        self.check(json.dumps({"grammars": [{"lark_grammar": f"start: /{llguidance.regex_to_lark(pattern)}/"}]}),
                   "regex", path)
        return self.lark.terminal(f"/{llguidance.regex_to_lark(pattern)}/")

    def _elements(self, node: dict, path: str) -> list:
        elements = _field(node, "elements", list, path)
        if not elements:
            raise StructuralTagError(f"{path}.elements: must not be empty")
        return elements

    def _sequence(self, node: dict, path: str) -> str:
        elements = self._elements(node, path)
        parts, i = [], 0
        while i < len(elements):
            here = f"{path}.elements[{i}]"
            nxt = elements[i + 1] if i + 1 < len(elements) else None
            if _is_any_text(elements[i]) and isinstance(nxt, dict) and nxt.get("type") == "const_string" \
                    and isinstance(nxt.get("value"), str) and nxt["value"]:
                parts.append(self._text_until(elements[i], [nxt["value"]], here))  # text up to the next string
                i += 2
                continue
            parts.append(self.element(elements[i], here))
            i += 1
        return _join(parts)

    def _or(self, node: dict, path: str) -> str:
        elements = self._elements(node, path)
        return "(" + " | ".join(self.element(e, f"{path}.elements[{i}]") for i, e in enumerate(elements)) + ")"

    def _optional(self, node: dict, path: str) -> str:
        return f"({self.element(node.get('content'), f'{path}.content')})?"

    def _star(self, node: dict, path: str) -> str:
        return f"({self.element(node.get('content'), f'{path}.content')})*"

    def _plus(self, node: dict, path: str) -> str:
        return f"({self.element(node.get('content'), f'{path}.content')})+"

    def _repeat(self, node: dict, path: str) -> str:
        low, high = _field(node, "min", int, path), _field(node, "max", int, path)
        if low < 0 or (high != -1 and high < low):
            raise StructuralTagError(f"{path}: need 0 <= min <= max (or max -1), got {low}, {high}")
        content = self.element(node.get("content"), f"{path}.content")
        return f"({content}){{{low},}}" if high == -1 else f"({content}){{{low},{high}}}"

    def _any_text(self, node: dict, path: str) -> str:
        _check_any_text(node, path)
        return _text_terminal(self.lark, _strings(node, "excludes", path, []))

    def _text_until(self, node: dict, ends: list[str], path: str) -> str:
        """Any text (without the excludes of `node`) up to the first of `ends`, which is included."""
        _check_any_text(node, path)
        text = _text_terminal(self.lark, _strings(node, "excludes", path, []))
        end = self.lark.terminal(" | ".join(lark_string(e) for e in ends))
        return self.lark.rule(f"{text} {end}", "text", "[lazy]")

    def _tag_parts(self, node: dict, path: str) -> tuple[str, str]:
        """(begin, the rest of the tag) of a tag element."""
        begin = node.get("begin")
        if not isinstance(begin, str):
            raise StructuralTagError(f"{path}.begin: only a string is supported (not a token)")
        end = node.get("end")
        ends = [end] if isinstance(end, str) else end
        if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
            raise StructuralTagError(f"{path}.end: expected a string or a list of strings (not a token)")
        content = node.get("content")
        if _is_any_text(content) and all(ends):
            return begin, self._text_until(content, ends, f"{path}.content")
        inner = self.element(content, f"{path}.content")
        literal = [e for e in ends if e]
        if len(literal) < len(ends):  # an empty end: the closing string is optional
            close = f"({' | '.join(lark_string(e) for e in literal)})?" if literal else None
        else:
            close = "(" + " | ".join(lark_string(e) for e in literal) + ")"
        return begin, _join([inner, close])

    def _tag(self, node: dict, path: str) -> str:
        begin, rest = self._tag_parts(node, path)
        return _join([_lit(begin), rest])

    def _tags(self, node: dict, path: str) -> list:
        tags = _field(node, "tags", list, path)
        if not tags:
            raise StructuralTagError(f"{path}.tags: must not be empty")
        for i, tag in enumerate(tags):
            if not isinstance(tag, dict) or tag.get("type", "tag") != "tag":
                raise StructuralTagError(f"{path}.tags[{i}]: expected a tag")
        return tags

    def _triggered_tags(self, node: dict, path: str) -> str:
        triggers = _strings(node, "triggers", path)
        if not triggers or not all(triggers):
            raise StructuralTagError(f"{path}.triggers: expected non-empty strings")
        excludes = _strings(node, "excludes", path, [])
        at_least_one = _field(node, "at_least_one", bool, path, False)
        stop_after_first = _field(node, "stop_after_first", bool, path, False)
        text = _text_terminal(self.lark, excludes)
        heads = {}  # trigger -> lazy rule: any text, then the trigger
        alternatives = []
        for i, tag in enumerate(self._tags(node, path)):
            here = f"{path}.tags[{i}]"
            begin, rest = self._tag_parts(tag, here)
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise StructuralTagError(f"{here}.begin: {begin!r} starts with none of the triggers")
            if trigger not in heads:
                heads[trigger] = self.lark.rule(f"{text} {lark_string(trigger)}", "trigger", "[lazy]")
            alternatives.append(_join([heads[trigger], _lit(begin[len(trigger):]), rest]))
        one = self.lark.rule(" | ".join(alternatives), "tags")
        tail = _text_terminal(self.lark, excludes + triggers)  # text after the last tag holds no trigger
        if stop_after_first:
            return one if at_least_one else f"({one} | {tail})"
        return f"({one}+ {tail})" if at_least_one else f"({one}* {tail})"

    def _tags_with_separator(self, node: dict, path: str) -> str:
        separator = _field(node, "separator", str, path)
        at_least_one = _field(node, "at_least_one", bool, path, False)
        stop_after_first = _field(node, "stop_after_first", bool, path, False)
        tags = [self._tag(t, f"{path}.tags[{i}]") for i, t in enumerate(self._tags(node, path))]
        one = self.lark.rule(" | ".join(tags), "tags")
        if stop_after_first:
            return one if at_least_one else f"({one})?"
        many = f"{one} ({_lit(separator) or ''} {one})*"
        return f"({many})" if at_least_one else f"({many})?"


def _is_any_text(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "any_text"


def _check_any_text(node: dict, path: str) -> None:
    if node.get("max_tokens") is not None or node.get("max_chars") is not None:
        raise StructuralTagError(f"{path}: max_tokens and max_chars are not supported")


def structural_tag_grammar(tag: dict) -> str:
    """The llguidance grammar of an xgrammar structural tag (``{"type": "structural_tag", "format": {...}}``);
    StructuralTagError naming the element at fault."""
    import llguidance

    if tag.get("type") != "structural_tag":
        raise StructuralTagError(f"type: expected 'structural_tag', got {tag.get('type')!r}")
    if "format" not in tag:
        raise StructuralTagError("missing 'format'")

    def check(grammar: str, what: str, path: str) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise StructuralTagError(f"{path}: invalid {what}: {reason(error)}")

    translator = _Translator(check)
    top = translator.element(tag["format"], "format")
    lines = [f"start: {top}", *translator.lark.lines]
    if translator.uses_empty:
        lines.append("empty: ")
    main = HEADER + "\n".join(lines)
    if not translator.lark.side:
        return llguidance.LLMatcher.grammar_from_lark(main)
    return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": main}, *translator.lark.side]})
