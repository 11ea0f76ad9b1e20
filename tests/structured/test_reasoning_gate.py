"""The reasoning gate: free tokens inside <think>...</think> (or a chat format's own tags), the grammar after it
(Qwen2-style vocabularies)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from gpullama.structured import (
    ReasoningGatedMatcher,
    StructuredOutput,
    get_backend,
    reasoning_token_ids,
    tool_call_grammar,
)
from gpullama.structured.vocab import grammar_vocab
from tests.structured.helpers import allowed_ids, greedy_tokens

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def qwen(tokenizers):
    tok = tokenizers["qwen2"]
    backend = get_backend(tok)
    return tok, backend, grammar_vocab(tok), backend.compile(StructuredOutput(json_schema=SCHEMA))


def _gate(qwen, start_in_reasoning=False):
    tok, backend, _, compiled = qwen
    open_id, close_id = reasoning_token_ids(tok)
    return ReasoningGatedMatcher(backend.matcher(compiled), open_id, close_id, backend.stop_token_ids,
                                 start_in_reasoning=start_in_reasoning)


def _mask(backend, matcher) -> set[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    return set(allowed_ids(bitmask, 0, backend.vocab_size).tolist())


def test_token_ids(tokenizers, qwen):
    tok = qwen[0]
    assert reasoning_token_ids(tok) == (tok._tokens.index("<think>"), tok._tokens.index("</think>"))
    assert reasoning_token_ids(tokenizers["smollm2"]) is None  # no such single tokens


def test_reasoning_is_free_and_the_answer_follows_the_grammar(qwen):
    tok, backend, vocab, compiled = qwen
    gate = _gate(qwen)
    plain = _mask(backend, backend.matcher(compiled))
    assert _mask(backend, gate) == plain | {gate.open_id}  # the grammar's first tokens, or the open tag
    assert gate.accept_token(gate.open_id) and gate.in_reasoning
    assert _mask(backend, gate) == set(range(backend.vocab_size))
    thoughts = tok.encode("I think n is 7, not {oops")
    assert all(gate.accept_token(t) for t in thoughts) and gate.in_reasoning
    assert gate.accept_token(gate.close_id) and not gate.in_reasoning
    assert _mask(backend, gate) == plain  # the grammar from its start
    answer = greedy_tokens(vocab, b'{"n": 7}')
    assert all(gate.accept_token(t) for t in answer)
    assert not gate.accept_token(gate.open_id)
    assert gate.accept_token(backend.stop_token_ids[0]) and gate.is_terminated()
    assert json.loads(b"".join(vocab[t] for t in answer)) == {"n": 7}
    jsonschema.validate({"n": 7}, SCHEMA)


def test_no_reasoning_goes_straight_to_the_grammar(qwen):
    _, backend, vocab, compiled = qwen
    gate = _gate(qwen)
    first = greedy_tokens(vocab, b"{")[0]
    assert gate.accept_token(first) and not gate.in_reasoning
    assert gate.open_id not in _mask(backend, gate)
    assert not gate.accept_token(gate.open_id)
    plain = backend.matcher(compiled)
    plain.accept_token(first)
    assert _mask(backend, gate) == _mask(backend, plain)


def test_started_inside_the_prompt_opened_block(qwen):
    tok, backend, _, _ = qwen
    gate = _gate(qwen, start_in_reasoning=True)
    assert gate.in_reasoning and _mask(backend, gate) == set(range(backend.vocab_size))
    assert gate.accept_token(tok.encode("hm")[0]) and gate.accept_token(gate.close_id)
    assert not gate.in_reasoning


def test_eos_inside_the_reasoning_ends_the_sequence(qwen):
    _, backend, _, _ = qwen
    gate = _gate(qwen, start_in_reasoning=True)
    assert gate.accept_token(backend.stop_token_ids[0]) and gate.is_terminated()
    assert _mask(backend, gate) == set(backend.stop_token_ids)
    assert not gate.accept_token(5)


def test_rollback_across_the_close_tag(qwen):
    tok, backend, vocab, _ = qwen
    gate = _gate(qwen)
    steps = [gate.open_id, *tok.encode("ok"), gate.close_id, *greedy_tokens(vocab, b'{"n": 1')]
    masks = []
    for t in steps:
        masks.append(_mask(backend, gate))
        assert gate.accept_token(t)
    for back in (3, 2, 1):  # into the answer, onto the close tag, into the reasoning
        gate.rollback(back)
        assert _mask(backend, gate) == masks[len(steps) - back]
        for t in steps[len(steps) - back:]:
            assert gate.accept_token(t)
    gate.rollback(len(steps))
    assert _mask(backend, gate) == masks[0]
    with pytest.raises(ValueError):
        gate.rollback(1)
    gate.accept_token(gate.open_id)
    gate.reset()
    assert _mask(backend, gate) == masks[0]


def test_gated_rows_fill_with_the_batch(qwen):
    _, backend, _, compiled = qwen
    gated, plain = _gate(qwen), backend.matcher(compiled)
    bitmask = backend.allocate_bitmask(3)
    bitmask[1].fill_(0)
    backend.fill_bitmask([gated, plain], bitmask, rows=[0, 2])
    assert set(allowed_ids(bitmask, 0, backend.vocab_size)) == _mask(backend, plain) | {gated.open_id}
    assert not allowed_ids(bitmask, 1, backend.vocab_size).size  # a row not given is left alone
    logits = torch.zeros(3, backend.vocab_size)
    backend.apply_bitmask(logits, bitmask, rows=[0, 2])
    assert torch.isfinite(logits[1]).all()


# ---- a chat format's own reasoning tags (Gemma 4's, DeepSeek V3.2 / V4's), its forced calls after them ----

GEMMA_TAGS = ("<|channel>thought", "<channel|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}]
SCHEMAS = {"get_weather": TOOLS[0]["function"]["parameters"]}


@pytest.fixture(scope="module")
def markers(vocab_tokenizer):
    """The Qwen2-style vocabulary with the 2026 formats' markers as single tokens, and its backend."""
    tok = vocab_tokenizer("qwen2-markers")
    return tok, get_backend(tok), grammar_vocab(tok)


def test_token_ids_of_a_formats_tags(tokenizers, markers):
    """A tag that is one token is that token; Gemma 4's ``<|channel>thought`` opens with its special token
    ``<|channel>``; a tag spelled only by plain tokens has no id (SmolLM2's ``<`` is not special)."""
    tok = markers[0]
    index = tok._tokens.index
    assert reasoning_token_ids(tok, *GEMMA_TAGS) == (index("<|channel>"), index("<channel|>"))
    assert reasoning_token_ids(tok) == (index("<think>"), index("</think>"))
    assert reasoning_token_ids(tokenizers["qwen2"], *GEMMA_TAGS) is None
    assert reasoning_token_ids(tokenizers["smollm2"], "<think", "</think>") is None


def _walk(gate, backend, steps) -> set[int] | None:
    """Accept `steps`, checking each against the gate's mask; return the last mask."""
    mask = None
    for t in steps:
        mask = _mask(backend, gate)
        assert t in mask and gate.accept_token(t), t
    return mask


@pytest.mark.parametrize("fmt, opened", [("gemma4", False), ("deepseek_v3_2", True), ("deepseek_v4", True)])
def test_a_forced_call_after_the_formats_reasoning(markers, fmt, opened):
    """With the format's tags, the model thinks first (free text, even text the grammar refuses), then the
    forced call: the format's output parser reads the reasoning and the call (Gemma 4 opens its block itself;
    DeepSeek's prompt opened ``<think>`` when thinking is on)."""
    from gpullama.chat.formats import FORMAT_BY_NAME

    tok, backend, vocab = markers
    form = FORMAT_BY_NAME[fmt]
    spec = tool_call_grammar(TOOLS, "required", parallel_tool_calls=False, format=form.grammar.name)
    ids = reasoning_token_ids(tok, *form.think_tags)
    gate = ReasoningGatedMatcher(backend.matcher(backend.compile(spec)), *ids, backend.stop_token_ids,
                                 start_in_reasoning=opened)
    thought = "The user wants Paris {not a call"
    steps = ([] if opened else [gate.open_id, *tok.encode("thought\n")]) + tok.encode(thought)
    assert _walk(gate, backend, steps) == set(range(backend.vocab_size)) and gate.in_reasoning
    assert gate.accept_token(gate.close_id) and not gate.in_reasoning
    call = form.grammar.render([("get_weather", {"city": "Paris", "days": 3})])
    answer = greedy_tokens(vocab, call.encode())
    assert _mask(backend, gate) == _mask(backend, backend.matcher(backend.compile(spec)))  # the grammar's start
    _walk(gate, backend, answer)
    assert gate.accept_token(backend.stop_token_ids[0]) and gate.is_terminated()
    text = tok.decode(steps + [gate.close_id] + answer)
    prompt = "" if not opened else "<｜Assistant｜><think>"
    out = form.output_parser(SCHEMAS, form.reasoning_parser(prompt)).parse(text)
    assert out.reasoning == thought and not out.content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                           "days": 3})]
