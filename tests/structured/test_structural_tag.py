"""Structural tags (xgrammar's JSON format) on llguidance: each supported element type accepts the texts it
describes and refuses the others; unsupported and unknown types are one clear error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from gpullama.structured import StructuredOutput, StructuredOutputError, get_backend
from gpullama.structured.vocab import grammar_vocab
from tests.structured.helpers import greedy_tokens, random_walk

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}


@pytest.fixture(scope="module")
def smol(tokenizers):
    tok = tokenizers["smollm2"]
    return get_backend(tok), grammar_vocab(tok)


def _tag(fmt: dict) -> StructuredOutput:
    return StructuredOutput(structural_tag={"type": "structural_tag", "format": fmt}, param="p")


def _accepts(smol, fmt: dict, text: str) -> bool:
    """Whether the grammar takes `text` (spelled greedily, any tokenization must do) and then the end."""
    backend, vocab = smol
    matcher = backend.matcher(backend.compile(_tag(fmt)))
    return all(matcher.accept_token(t) for t in greedy_tokens(vocab, text.encode())) and \
        matcher.accept_token(backend.stop_token_ids[0])


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def test_sequence_const_and_json_schema(smol):
    fmt = {"type": "sequence", "elements": [_const("<f>"), {"type": "json_schema", "json_schema": WEATHER},
                                            _const("</f>")]}
    assert _accepts(smol, fmt, '<f>{"city": "Paris"}</f>')
    assert not _accepts(smol, fmt, '<f>{"city":"Paris"}</f>')  # compact, as every gpullama JSON
    assert not _accepts(smol, fmt, '<f>{"city": "Paris", "x": 1}</f>')  # strict
    assert not _accepts(smol, fmt, '<f>{"city": "Paris"}')


def test_or_optional_star_plus_repeat(smol):
    ab = {"type": "or", "elements": [_const("a"), _const("b")]}
    assert _accepts(smol, ab, "a") and _accepts(smol, ab, "b") and not _accepts(smol, ab, "c")
    opt = {"type": "sequence", "elements": [_const("x"), {"type": "optional", "content": _const("y")}, _const("z")]}
    assert _accepts(smol, opt, "xz") and _accepts(smol, opt, "xyz") and not _accepts(smol, opt, "xyyz")
    star = {"type": "sequence", "elements": [_const("["), {"type": "star", "content": _const("1;")}, _const("]")]}
    assert _accepts(smol, star, "[]") and _accepts(smol, star, "[1;1;1;]")
    plus = {"type": "sequence", "elements": [_const("["), {"type": "plus", "content": _const("1;")}, _const("]")]}
    assert not _accepts(smol, plus, "[]") and _accepts(smol, plus, "[1;]")
    rep = {"type": "repeat", "min": 2, "max": 3, "content": _const("ha")}
    assert [_accepts(smol, rep, "ha" * n) for n in range(1, 5)] == [False, True, True, False]
    unbounded = {"type": "repeat", "min": 2, "max": -1, "content": _const("ha")}
    assert not _accepts(smol, unbounded, "ha") and _accepts(smol, unbounded, "ha" * 6)


def test_regex_and_grammar_elements(smol):
    regex = {"type": "sequence", "elements": [_const("id="), {"type": "regex", "pattern": r"[A-Z]{2}\d{3}"}]}
    assert _accepts(smol, regex, "id=AB123") and not _accepts(smol, regex, "id=AB12")
    ebnf = {"type": "grammar", "grammar": 'root ::= "(" [0-9]+ ")"'}
    assert _accepts(smol, ebnf, "(42)") and not _accepts(smol, ebnf, "(4x)")
    lark = {"type": "grammar", "syntax": "lark", "grammar": 'start: "yes" | "no"'}
    assert _accepts(smol, lark, "no") and not _accepts(smol, lark, "maybe")


def test_tag_with_text_and_several_ends(smol):
    fmt = {"type": "tag", "begin": "<note>", "content": {"type": "any_text"}, "end": ["</note>", "</n>"]}
    assert _accepts(smol, fmt, "<note>anything, even {json} or\nlines</note>")
    assert _accepts(smol, fmt, "<note>short</n>")
    assert not _accepts(smol, fmt, "<note>done</note> and more")  # the end closes the tag
    excl = {"type": "tag", "begin": "<q>", "content": {"type": "any_text", "excludes": ["BAD"]}, "end": "</q>"}
    assert _accepts(smol, excl, "<q>fine</q>") and not _accepts(smol, excl, "<q>so BAD</q>")


def _tools(**flags) -> dict:
    return {"type": "triggered_tags", "triggers": ["<call="], "tags": [
        {"type": "tag", "begin": "<call=weather>", "content": {"type": "json_schema", "json_schema": WEATHER},
         "end": "</call>"},
        {"type": "tag", "begin": "<call=time>", "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {}}}, "end": "</call>"}], **flags}


def test_triggered_tags(smol):
    call = '<call=weather>{"city": "Oslo"}</call>'
    free = _tools()
    assert _accepts(smol, free, "No tool needed.")
    assert _accepts(smol, free, f"Let me check. {call} Done, and <call=time>{{}}</call>")
    assert not _accepts(smol, free, "Trying <call=nope>{}</call>")  # a trigger must open a tag
    assert not _accepts(smol, free, '<call=weather>{"town": "Oslo"}</call>')
    at_least_one = _tools(at_least_one=True)
    assert not _accepts(smol, at_least_one, "No tool needed.") and _accepts(smol, at_least_one, "ok " + call)
    first = _tools(stop_after_first=True, at_least_one=True)
    assert _accepts(smol, first, call) and not _accepts(smol, first, call + " more text")
    excludes = _tools(excludes=["secret"])
    assert not _accepts(smol, excludes, "the secret is out") and _accepts(smol, excludes, "nothing to hide")


def test_tags_with_separator(smol):
    tag = {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
           "end": "</a>"}
    fmt = {"type": "tags_with_separator", "tags": [tag], "separator": ","}
    assert _accepts(smol, fmt, "") and _accepts(smol, fmt, "<a>1</a>,<a>2</a>") and not _accepts(smol, fmt, "x")
    assert not _accepts(smol, {**fmt, "at_least_one": True}, "")
    assert not _accepts(smol, {**fmt, "stop_after_first": True}, "<a>1</a>,<a>2</a>")


def test_random_walks_follow_the_structure(smol):
    backend, vocab = smol
    tags = _tools()["tags"]
    spec = _tag({"type": "sequence", "elements": [
        _const("Calling: "), {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}]})
    call = re.compile(r'<call=(weather|time)>(.*?)</call>')
    for seed in range(3):
        walk = random_walk(backend, spec, vocab.__getitem__, seed, steer_after=40)
        text = walk.text.decode()
        assert walk.terminated and text.startswith("Calling: "), text
        calls = call.findall(text)
        assert calls and "\n".join(f"<call={n}>{a}</call>" for n, a in calls) == text[len("Calling: "):], text
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), WEATHER if name == "weather" else {"type": "object"})


@pytest.mark.parametrize("fmt, message", [
    ({"type": "nope"}, "invalid structural tag: format: unknown type 'nope'"),
    ({"type": "sequence", "elements": [_const("a"), {"type": "token", "token": 5}]},
     r"format.elements\[1\]: type 'token' is not supported"),
    ({"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}, "'qwen_xml' is not supported"),
    ({"type": "const_string"}, "format: missing 'value'"),
    ({"type": "json_schema", "json_schema": {"$ref": "#/$defs/x"}}, "format: invalid JSON schema"),
    ({"type": "regex", "pattern": "a("}, "format: invalid regex"),
    ({"type": "triggered_tags", "triggers": ["<x"], "tags": [{"type": "tag", "begin": "<y>", "content": _const(""),
                                                              "end": ""}]}, "starts with none of the triggers"),
])
def test_errors_name_the_element(smol, fmt, message):
    backend, _ = smol
    with pytest.raises(StructuredOutputError, match=message) as info:
        backend.compile(_tag(fmt))
    assert info.value.param == "p" and "invalid structural tag" in str(info.value)
