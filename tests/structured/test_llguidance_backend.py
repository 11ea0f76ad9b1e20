"""What the llguidance backend adds on top of the engine: the strict-schema step, the matcher contract (a refused
token changes nothing, rollback past the start is an error), every tokenization allowed, JSON strings and formats."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from gpullama.structured import StructuredOutput, StructuredOutputError, get_backend
from gpullama.structured.llguidance_grammars import strict_schema
from gpullama.structured.vocab import grammar_vocab
from tests.structured.helpers import allowed_ids, greedy_tokens, random_walk


@pytest.fixture(scope="module")
def smol(tokenizers):
    tok = tokenizers["smollm2"]
    return get_backend(tok), grammar_vocab(tok)


def _accepts(smol, spec: StructuredOutput, text: str) -> bool:
    backend, vocab = smol
    matcher = backend.matcher(backend.compile(spec))
    return all(matcher.accept_token(t) for t in greedy_tokens(vocab, text.encode())) and \
        matcher.accept_token(backend.stop_token_ids[0])


def test_strict_schema_closes_objects_and_tuples_but_not_all_of():
    inner = {"type": "object", "properties": {"b": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": inner, "t": {"prefixItems": [{"type": "string"}]},
                                               "free": {"type": "object", "additionalProperties": True},
                                               "c": {"const": {"type": "object"}}},
              "$defs": {"D": {"properties": {"x": {}}}},
              "allOf": [{"properties": {"p": {"type": "integer"}}}]}
    out = strict_schema(schema)
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["t"]["items"] is False
    assert out["properties"]["free"]["additionalProperties"] is True
    assert out["properties"]["c"] == {"const": {"type": "object"}}  # a value, not a schema: untouched
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in out and "additionalProperties" not in out["allOf"][0]
    assert "additionalProperties" not in schema["properties"]["a"]  # the caller's schema is not changed


def test_all_of_branches_combine(smol):
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert _accepts(smol, StructuredOutput(json_schema=schema), '{"a": 1, "b": 2}')
    jsonschema.validate({"a": 1, "b": 2}, schema)


def test_refused_token_leaves_the_matcher_as_it_was(smol):
    backend, vocab = smol
    matcher = backend.matcher(backend.compile(StructuredOutput(regex="ab+c")))
    bitmask = backend.allocate_bitmask(1)
    assert matcher.accept_token(vocab.index(b"a"))
    matcher.fill_bitmask(bitmask, 0)
    before = allowed_ids(bitmask, 0, backend.vocab_size).tolist()
    assert not matcher.accept_token(vocab.index(b"c")) and not matcher.accept_token(backend.stop_token_ids[0])
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, backend.vocab_size).tolist() == before
    rest = greedy_tokens(vocab, b"bbc")
    assert all(matcher.accept_token(t) for t in rest)
    n = 1 + len(rest)
    with pytest.raises(ValueError, match=f"cannot roll back {n + 1} tokens, {n} accepted"):
        matcher.rollback(n + 1)
    assert matcher.accept_token(backend.stop_token_ids[1]) and matcher.is_terminated()
    matcher.rollback(n + 1)  # the stop token and all the others
    assert not matcher.is_terminated() and matcher.accept_token(vocab.index(b"a"))


def test_every_tokenization_of_forced_text_is_allowed(smol):
    """Without llguidance's forcing, the first mask of `{"name": ...` holds `{` as well as `{"`."""
    backend, vocab = smol
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    matcher = backend.matcher(backend.compile(StructuredOutput(json_schema=schema)))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    allowed = {vocab[i] for i in allowed_ids(bitmask, 0, backend.vocab_size)}
    assert {b"{", b'{"'} <= allowed and all(b'{"name'.startswith(b) for b in allowed)


def test_strings_take_escapes_not_raw_control_characters(smol):
    spec = StructuredOutput(json_schema={"type": "object", "properties": {"s": {"type": "string"}},
                                         "required": ["s"]})
    assert _accepts(smol, spec, '{"s": "tab\\there \\u0001 \\"q\\" \\\\"}')
    for raw in ("\t", "\n", "\x01", "\x7f"):
        assert not _accepts(smol, spec, f'{{"s": "a{raw}b"}}'), repr(raw)


def test_formats_are_enforced(smol):
    backend, vocab = smol
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                               "id": {"type": "string", "format": "uuid"}},
              "required": ["when", "id"]}
    spec = StructuredOutput(json_schema=schema)
    assert _accepts(smol, spec, '{"when": "2026-12-03", "id": "123e4567-e89b-12d3-a456-426614174000"}')
    assert not _accepts(smol, spec, '{"when": "yesterday", "id": "123e4567-e89b-12d3-a456-426614174000"}')
    for seed in range(2):
        walk = random_walk(backend, spec, vocab.__getitem__, seed, steer_after=60)
        value = json.loads(walk.text)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", value["when"]) and len(value["id"]) == 36, walk.text


def test_unsupported_keywords_are_ignored_and_look_ahead_is_refused(smol):
    backend, _ = smol
    ignored = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}, "required": ["n"]}
    assert _accepts(smol, StructuredOutput(json_schema=ignored), '{"n": 4}')
    for spec in (StructuredOutput(json_schema={"type": "string", "pattern": "(?=a)b"}, param="s"),
                 StructuredOutput(regex="a(?=b)", param="s")):
        with pytest.raises(StructuredOutputError, match="look-around") as info:
            backend.compile(spec)
        assert info.value.param == "s" and "\n" not in str(info.value)


def test_regex_classes_are_ascii_and_grammars_may_be_lark(smol):
    assert _accepts(smol, StructuredOutput(regex=r"\w+ \d"), "ab_1 7")
    assert not _accepts(smol, StructuredOutput(regex=r"\d"), "٣")  # an Arabic-Indic digit
    lark = 'start: "x=" NUM\nNUM: /[0-9]+/'
    assert _accepts(smol, StructuredOutput(grammar=lark), "x=42")
    assert not _accepts(smol, StructuredOutput(grammar=lark), "x=")


def test_array_valued_items_are_a_tuple_as_llamacpp_reads_them(smol):
    """Draft 4-7's ``"items": [...]`` (which draft 2020-12 refuses) is read as ``prefixItems`` with nothing after
    them, all required, as llama.cpp's converter reads it; data under enum/default is left alone, a property named "default" is
    still a schema."""
    schema = {"type": "object", "properties": {
        "pair": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}], "default": {"items": [1]}},
        "default": {"type": "array", "items": [{"type": "boolean"}]}}, "required": ["pair", "default"]}
    spec = StructuredOutput(json_schema=schema)
    pair = spec.json_schema["properties"]["pair"]
    assert pair["prefixItems"] == [{"type": "string"}, {"type": "integer"}] and pair["items"] is False
    assert pair["default"] == {"items": [1]} and spec.json_schema["properties"]["default"]["items"] is False
    assert _accepts(smol, spec, '{"pair": ["a", 1], "default": [true]}')
    assert not _accepts(smol, spec, '{"pair": ["a", 1, 2], "default": [true]}')
    assert not _accepts(smol, spec, '{"pair": [1, "a"], "default": [true]}')
    assert not _accepts(smol, spec, '{"pair": ["a"], "default": [true]}')  # every item, as llama.cpp's tuple
