"""Decoding under grammars on real vocabularies with random logits: every output parses and validates."""

from __future__ import annotations

import json
import re
import threading
from typing import Literal, Optional

import jsonschema
import pydantic
import pytest

from gpullama.structured import (
    TOOL_CALL_FORMATS,
    StructuredOutput,
    StructuredOutputError,
    get_backend,
    tool_call_grammar,
)
from gpullama.structured.vocab import grammar_vocab
from gpullama.tokenizer import BYTE, NORMAL
from tests.structured.helpers import allowed_ids, greedy_tokens, is_compact_json, random_walk


class Address(pydantic.BaseModel):
    street: str
    zip: Optional[str] = None


class Person(pydantic.BaseModel):
    name: str
    age: int
    role: Literal["admin", "user"]
    tags: list[str]
    address: Address


SCHEMAS = {
    "flat": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                              "c": {"type": "boolean"}, "d": {"type": "null"}},
             "required": ["a", "b", "c", "d"]},
    "optional": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "string"}},
                 "required": ["y"]},
    "bounded": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 3, "maximum": 17},
        "s": {"type": "string", "minLength": 2, "maxLength": 6},
        "l": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}},
        "required": ["n", "s", "l"]},
    "enum_const": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", 3, None]},
                                                    "v": {"const": "fixed"}}, "required": ["kind", "v"]},
    "nested": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"]}}}, "required": ["items"]},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"},
                                                                {"type": "array", "items": {"type": "boolean"}}]}},
               "required": ["v"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"]},
    "refs": Person.model_json_schema(),  # $defs / $ref, Optional, Literal, as the openai SDK's .parse() sends
    "array_root": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 4},
}


@pytest.fixture(scope="module")
def backends(tokenizers):
    return {name: get_backend(tok) for name, tok in tokenizers.items()}


@pytest.fixture(scope="module")
def vocabs(tokenizers):
    return {name: grammar_vocab(tok) for name, tok in tokenizers.items()}


def _decode(vocab, walk) -> str:
    assert walk.terminated, f"no end after {walk.steps} steps: {walk.text[:200]!r}"
    return walk.text.decode("utf-8")


@pytest.mark.parametrize("vocab_name", ["smollm2", "qwen2", "spm"])
@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(backends, vocabs, vocab_name, schema_name):
    schema = SCHEMAS[schema_name]
    backend, vocab = backends[vocab_name], vocabs[vocab_name]
    spec = StructuredOutput(json_schema=schema)
    for seed in range(3):
        text = _decode(vocab, random_walk(backend, spec, vocab.__getitem__, seed))
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert is_compact_json(text), text  # no free whitespace: ", " and ": " only
        if schema_name == "refs":
            Person.model_validate_json(text)


@pytest.mark.parametrize("vocab_name", ["smollm2", "spm"])
def test_json_object_outputs_are_objects(backends, vocabs, vocab_name):
    spec = StructuredOutput(json_object=True)
    for seed in range(6):
        text = _decode(vocabs[vocab_name], random_walk(backends[vocab_name], spec, vocabs[vocab_name].__getitem__,
                                                       seed, steer_after=12))
        assert isinstance(json.loads(text), dict), text


def test_regex_choice_and_ebnf(backends, vocabs):
    backend, vocab = backends["smollm2"], vocabs["smollm2"]
    regex = r"(yes|no), [0-9]{2,4} [a-z]+!"
    for seed in range(4):
        text = _decode(vocab, random_walk(backend, StructuredOutput(regex=regex), vocab.__getitem__, seed))
        assert re.fullmatch(regex, text), text
        choice = _decode(vocab, random_walk(backend, StructuredOutput(choice=["red", "green", "blue"]),
                                            vocab.__getitem__, seed))
        assert choice in ("red", "green", "blue")
    ebnf = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(4):
        text = _decode(vocab, random_walk(backend, StructuredOutput(grammar=ebnf), vocab.__getitem__, seed))
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text), text


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "now"}},
]
_CALL = re.compile(r'\{"name": "(\w+)", "(?:arguments|parameters)": ')


def _calls(fmt: str, text: str) -> list[tuple[str, dict]]:
    """Calls in grammar-written text: the regex finds each call's start, json decodes from there."""
    decoder = json.JSONDecoder()
    out = []
    for m in _CALL.finditer(text):
        obj, _ = decoder.raw_decode(text, m.start())
        out.append((obj["name"], obj.get("arguments", obj.get("parameters"))))
    return out


@pytest.mark.parametrize("fmt", ["generic", "hermes", "llama3", "mistral"])
@pytest.mark.parametrize("choice", ["required", "required-single", "named"])
def test_tool_call_grammars(backends, vocabs, fmt, choice):
    backend, vocab = backends["smollm2"], vocabs["smollm2"]
    if choice == "named":
        spec = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, format=fmt)
    else:
        spec = tool_call_grammar(TOOLS, "required", parallel_tool_calls=choice == "required", format=fmt)
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
               for t in TOOLS}
    for seed in range(5):
        text = _decode(vocab, random_walk(backend, spec, vocab.__getitem__, seed, steer_after=40))
        calls = _calls(fmt, text)
        assert calls, text
        for name, arguments in calls:
            jsonschema.validate(arguments, schemas[name])
            if choice == "named":
                assert name == "get_weather"
        rendered = {"generic": None, "hermes": "<tool_call>\n", "llama3": None, "mistral": "[TOOL_CALLS]["}[fmt]
        if rendered:
            assert text.startswith(rendered), text
        if choice != "required":
            assert len(calls) == 1, text


@pytest.mark.parametrize("fmt", ["generic", "hermes", "llama3", "mistral"])
def test_tool_call_grammars_accept_the_rendered_format(backends, vocabs, fmt):
    """Each grammar takes the text its format renders: one call, and several only when parallel."""
    backend, vocab = backends["smollm2"], vocabs["smollm2"]
    form = TOOL_CALL_FORMATS[fmt]
    one = [("add", {"a": 1, "b": -2})]
    two = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {})]

    def accepts(spec, text: str) -> bool:
        matcher = backend.matcher(backend.compile(spec))
        return all(matcher.accept_token(t) for t in greedy_tokens(vocab, text.encode())) and \
            matcher.accept_token(backend.stop_token_ids[0])

    parallel = tool_call_grammar(TOOLS, "required", format=fmt)
    single = tool_call_grammar(TOOLS, "required", parallel_tool_calls=False, format=fmt)
    named = tool_call_grammar(TOOLS, "add", format=fmt)
    assert accepts(parallel, form.render(one)) and accepts(parallel, form.render(two, parallel=True))
    assert accepts(single, form.render(one)) and not accepts(single, form.render(two, parallel=True))
    assert accepts(named, form.render(one)) and not accepts(named, form.render(two[:1]))
    assert not accepts(parallel, form.render([("add", {"a": 1})]))  # b is required
    assert not accepts(parallel, form.render([("add", {"a": 1, "b": 2, "c": 3})]))  # strict: no extra key
    assert not accepts(parallel, form.render([("sub", {"a": 1, "b": 2})]))


def test_terminated_matcher_allows_only_eos(backends, vocabs):
    backend, vocab = backends["smollm2"], vocabs["smollm2"]
    spec = StructuredOutput(choice=["ok"])
    matcher = backend.matcher(backend.compile(spec))
    bitmask = backend.allocate_bitmask(2)
    for t in [vocab.index(b"ok")]:
        assert matcher.accept_token(t)
    backend.fill_bitmask([matcher], bitmask)  # complete: only EOS may follow
    assert allowed_ids(bitmask, 0, backend.vocab_size).tolist() == [0, 2]
    assert matcher.accept_token(2) and matcher.is_terminated()
    backend.fill_bitmask([matcher], bitmask, rows=[1])  # a terminated matcher fills EOS only
    assert allowed_ids(bitmask, 1, backend.vocab_size).tolist() == [0, 2]
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, backend.vocab_size).tolist() == [0, 2]
    assert not matcher.accept_token(vocab.index(b"ok"))
    matcher.rollback(1)
    assert not matcher.is_terminated()
    matcher.reset()
    assert matcher.accept_token(vocab.index(b"ok"))


@pytest.mark.parametrize("vocab_name", ["smollm2", "qwen2", "spm"])
def test_special_tokens_are_never_allowed_inside_a_json_string(tokenizers, backends, vocabs, vocab_name):
    tok, backend, vocab = tokenizers[vocab_name], backends[vocab_name], vocabs[vocab_name]
    spec = StructuredOutput(json_schema={"type": "object", "properties": {"s": {"type": "string"}},
                                         "required": ["s"]})
    matcher = backend.matcher(backend.compile(spec))
    for t in greedy_tokens(vocab, b'{"s": "'):
        assert matcher.accept_token(t)
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    allowed = set(allowed_ids(bitmask, 0, backend.vocab_size).tolist())
    kinds = tok._types
    special = {i for i, k in enumerate(kinds) if k not in (NORMAL, BYTE)}
    assert special and not (allowed & special)
    plain = {i for i, b in enumerate(vocab)
             if b and all(0x20 <= c < 0x7F for c in b) and b'"' not in b and b"\\" not in b}
    assert plain <= allowed  # every printable-ASCII token without a quote or backslash may go in a string
    assert not any(b"\n" in vocab[i] for i in allowed)  # JSON strings take no raw newline
    assert not (allowed & set(backend.stop_token_ids))


def test_padded_logits_width(tokenizers):
    tok = tokenizers["qwen2"]
    backend = get_backend(tok, tok.vocab_size + 61)
    assert backend is get_backend(tok, tok.vocab_size + 61) and backend is not get_backend(tok)
    assert backend.allocate_bitmask(1).shape[1] * 32 >= tok.vocab_size + 61
    vocab = grammar_vocab(tok, tok.vocab_size + 61)
    spec = StructuredOutput(json_schema=SCHEMAS["flat"])
    walk = random_walk(backend, spec, vocab.__getitem__, 0)
    jsonschema.validate(json.loads(_decode(vocab, walk)), SCHEMAS["flat"])
    matcher = backend.matcher(backend.compile(StructuredOutput(json_object=True)))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, backend.vocab_size).max() < tok.vocab_size


@pytest.mark.parametrize("spec_kwargs, message", [
    (dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "invalid JSON schema"),
    (dict(regex="a(b"), "invalid regex"),
    (dict(grammar="root ::= undefined_rule"), "invalid grammar"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "invalid structural tag"),
])
def test_compile_errors_are_value_errors(backends, spec_kwargs, message):
    backend = backends["qwen2"]
    spec = StructuredOutput(**spec_kwargs, param="p")
    with pytest.raises(StructuredOutputError, match=message) as info:
        backend.compile(spec)
    assert info.value.param == "p" and ".cc:" not in str(info.value)
    with pytest.raises(StructuredOutputError):
        backend.compile_async(spec).result()
    assert backend.cached(spec) is None


def test_compile_cache_and_async(backends):
    backend = backends["spm"]
    spec = StructuredOutput(json_schema={"type": "object", "properties": {"k": {"type": "integer", "minimum": 7}}})
    futures = []
    threads = [threading.Thread(target=lambda: futures.append(backend.compile_async(spec))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = futures[0].result(timeout=30)
    assert all(f.result() is first for f in futures)  # one compilation for concurrent requests of a spec
    assert backend.compile(StructuredOutput(json_schema=dict(spec.json_schema))) is first
    assert backend.cached(spec) is first and first.compile_s >= 0
    assert backend.compile_async(spec).done()
    other = StructuredOutput(json_schema={"type": "object", "properties": {"k": {"type": "integer", "minimum": 8}}})
    assert backend.cached(other) is None and backend.compile(other) is not first


def test_one_backend_per_tokenizer(tokenizers):
    tok = tokenizers["qwen2"]
    assert get_backend(tok) is get_backend(tok, tok.vocab_size)
    with pytest.raises(ValueError, match="unknown grammar backend"):
        get_backend(tok, name="xgrammar")
