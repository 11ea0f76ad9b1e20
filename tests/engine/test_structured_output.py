"""Grammar-constrained sampling in the engine: valid outputs, untouched free rows, compilation off the step thread,
preemption, abort, compile errors and reasoning blocks."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid

import jsonschema
import numpy as np
import pytest
import torch

from gpullama import LLM, StructuredOutput
from gpullama.engine.llm_engine import GRAMMAR_WAIT_S
from gpullama.sampling_params import SamplingParams
from gpullama.structured import StructuredOutputError, get_backend, reasoning_token_ids
from tests.engine.helpers import assert_pool_idle, make_engine, run_requests, solo_runs
from tests.engine.test_preemption_abort import kv_block_bytes, prompts_of
from tests.structured.helpers import allowed_matrix

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
}
DIGITS = r"[0-9]{3,40}"  # a regex a random model follows for many tokens (a grammar that never ends early)


def unique(schema: dict) -> dict:
    """`schema` with a fresh description, so that it misses the compile cache."""
    return {**schema, "description": uuid.uuid4().hex}


def test_constrained_outputs_parse_and_validate(real_llm: LLM) -> None:
    """SmolLM2 sampling at temperature 1 over 4 prompts x 2 seeds, in one batch: every answer is schema-valid JSON
    and ends with "stop" (the grammar terminated); its last token, the EOS, is not in the text."""
    spec = StructuredOutput(json_schema=PERSON)
    prompts = [f"Describe {who} as a JSON object." for who in ("a pirate", "a teacher", "my cat", "a robot")]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_output=spec) for s in range(2)]
    engine = make_engine(real_llm)
    ids = [real_llm._encode_chat([{"role": "user", "content": p}]) for p in prompts]
    seqs = run_requests(engine, [i for i in ids for _ in params], [p for _ in ids for p in params])
    for seq in seqs:
        assert seq.finish_reason == "stop", seq.text
        assert seq.output_token_ids[-1] in real_llm.tokenizer.eos_token_ids
        jsonschema.validate(json.loads(seq.text), PERSON)
    assert len({seq.text for seq in seqs}) > 4  # sampled, not one answer repeated
    assert_pool_idle(engine.block_manager)


def test_mask_touches_only_the_constrained_rows(tiny_llm: LLM) -> None:
    """`mask` on a batch of four rows, two constrained: the free rows keep their exact logits; a constrained row
    keeps the logits its grammar allows (read from the bitmask with numpy) and has -inf everywhere else."""
    engine = make_engine(tiny_llm)
    prompts = prompts_of([5, 6, 7, 8], seed=3)
    specs = [None, StructuredOutput(json_schema=PERSON), None, StructuredOutput(regex=DIGITS)]
    seqs = [engine.admit(f"m{i}", p, SamplingParams(structured_output=s)) for i, (p, s) in
            enumerate(zip(prompts, specs))]
    for seq in seqs:
        if seq.grammar is not None:
            seq.grammar.future.result(timeout=60)
    vocab = tiny_llm.config.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    assert engine.structured_output.mask(logits, seqs) == {}
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = allowed_matrix(engine.structured_output._bitmask, vocab)
    for row in (1, 3):
        keep = torch.from_numpy(allowed[row])
        assert 0 < int(keep.sum()) < vocab
        assert torch.equal(logits[row][keep], before[row][keep])
        assert torch.isneginf(logits[row][~keep]).all()
    first = tiny_llm.tokenizer.token_bytes
    assert all(first(int(t)).startswith(b"{") for t in np.flatnonzero(allowed[1]))
    assert all(first(int(t)).isdigit() for t in np.flatnonzero(allowed[3]))


def test_free_requests_in_a_constrained_batch_are_unchanged(tiny_llm: LLM) -> None:
    """Free requests (greedy and seeded) batched with constrained ones produce the tokens they produce alone."""
    prompts = prompts_of([9, 30, 14, 50, 22, 40], seed=5)
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, seed=12, max_tokens=24, ignore_eos=True)]
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=24, structured_output=StructuredOutput(
        regex=DIGITS))
    params = [free[0], constrained, free[1], constrained, free[2], constrained]
    engine = make_engine(tiny_llm, max_num_batched_tokens=64)
    seqs = run_requests(engine, prompts, params)
    alone = solo_runs(tiny_llm, prompts[0::2], free)
    for seq, want in zip(seqs[0::2], alone):
        assert seq.output_token_ids == want.output_token_ids
    for seq in seqs[1::2]:
        assert seq.text.isdigit() and 3 <= len(seq.text) <= 40, seq.text
    assert_pool_idle(engine.block_manager)


def test_compilation_runs_off_the_step_thread_while_the_prompt_prefills(tiny_llm: LLM) -> None:
    """While a grammar compiles (held on an event), steps go on for the other requests without waiting for it,
    and the constrained request prefills all of its prompt but the last token; released, it finishes exactly as a
    request whose grammar was ready at once."""
    backend = get_backend(tiny_llm.tokenizer, tiny_llm.config.vocab_size)
    release, compiled = threading.Event(), []
    original = backend._compile

    def slow_compile(spec):
        release.wait(timeout=60)
        compiled.append(threading.current_thread().name)
        return original(spec)

    engine = make_engine(tiny_llm, max_num_batched_tokens=32)
    backend._compile = slow_compile
    try:
        spec = StructuredOutput(json_schema=unique(PERSON))
        prompt, other = prompts_of([120, 10], seed=7)
        params = SamplingParams(temperature=0.0, max_tokens=30, structured_output=spec)
        seq = engine.add_request("c", prompt, params)
        free = engine.add_request("f", other, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        for _ in range(20):
            start = time.perf_counter()
            engine.step()
            assert time.perf_counter() - start < 5 * GRAMMAR_WAIT_S + 1.0
        assert free.is_finished and free.num_output_tokens == 12  # the free request did not wait
        assert not compiled  # still held
        assert seq.num_computed_tokens == len(prompt) - 1 and seq.num_output_tokens == 0
        waited = time.perf_counter()
        engine.step()  # nothing to run: the step waits briefly for the grammar, then returns
        assert time.perf_counter() - waited < GRAMMAR_WAIT_S + 1.0
        release.set()
        while engine.has_work():
            engine.step()
    finally:
        backend._compile = original
        release.set()
    assert compiled and compiled[0].startswith("gpullama-grammar")
    again = run_requests(make_engine(tiny_llm), [prompt], params)[0]  # compiled now: ready at once
    assert seq.output_token_ids == again.output_token_ids and seq.finish_reason == again.finish_reason
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_keeps_the_matchers_right(tiny_model, tiny_llm: LLM, prefix_caching: bool) -> None:
    """A pool too small for the batch preempts and recomputes constrained requests: each one's tokens equal its
    solo run, and every output still follows its grammar."""
    llm = LLM(str(tiny_model("llama", "F32").path), device="cpu", dtype="float32", max_model_len=128,
              kv_cache_memory=12 * kv_block_bytes(tiny_llm), max_num_batched_tokens=64,
              enable_prefix_caching=prefix_caching)
    prompts = prompts_of([30, 41, 52, 60, 35, 47], seed=21)
    digits = SamplingParams(temperature=0.0, max_tokens=40, structured_output=StructuredOutput(regex=DIGITS))
    words = SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                           structured_output=StructuredOutput(regex=r"([a-z]+ ){10,30}"))
    params = [digits, words] * 3
    seqs = run_requests(llm.engine, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    want = solo_runs(tiny_llm, prompts, params)
    for i, (seq, w) in enumerate(zip(seqs, want)):
        assert seq.output_token_ids == w.output_token_ids, f"request {i} changed after preemption"
    for seq in seqs[0::2]:
        assert seq.text.isdigit() and 3 <= len(seq.text) <= 40
    for seq in seqs[1::2]:
        assert all(w.isalpha() and w.islower() for w in seq.text.split(" ") if w), seq.text
    assert_pool_idle(llm.engine.block_manager)


def test_abort_of_constrained_requests_spares_the_others(tiny_llm: LLM) -> None:
    """Constrained requests aborted while compiling, prefilling and decoding end with "abort"; the rest finish as
    they would alone."""
    engine = make_engine(tiny_llm, max_num_seqs=4, max_num_batched_tokens=48)
    prompts = prompts_of([40, 12, 70, 20, 33], seed=9)
    spec = StructuredOutput(regex=DIGITS)
    params = [SamplingParams(temperature=0.0, max_tokens=20, structured_output=spec),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    seqs = [engine.add_request(f"a{i}", p, params[i % 2]) for i, p in enumerate(prompts)]
    pending = engine.add_request("pending", prompts[0], SamplingParams(
        max_tokens=5, structured_output=StructuredOutput(json_schema=unique(PERSON))))
    engine.abort("pending")
    for _ in range(3):
        engine.step()
    engine.abort("a0")
    engine.abort("a4")  # still waiting or prefilling (max_num_seqs=4)
    last = {}
    while engine.has_work():
        for delta in engine.step():
            last[delta.request_id] = delta
    assert pending.finish_reason == seqs[0].finish_reason == seqs[4].finish_reason == "abort"
    kept = [seqs[1], seqs[2], seqs[3]]
    want = solo_runs(tiny_llm, [prompts[1], prompts[2], prompts[3]], [params[1], params[0], params[1]])
    for seq, w in zip(kept, want):
        assert seq.output_token_ids == w.output_token_ids
    assert_pool_idle(engine.block_manager)


def test_a_grammar_that_does_not_compile_fails_its_request_alone(tiny_llm: LLM) -> None:
    """A schema that jsonschema accepts but the grammar engine cannot compile (a dangling $ref) ends its request
    with finish_reason "error" and a StructuredOutputError naming the field; the batch goes on. `LLM.generate`
    raises it."""
    bad = StructuredOutput(json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}},
                           param="response_format")
    engine = make_engine(tiny_llm)
    prompts = prompts_of([20, 20], seed=2)
    ok = engine.add_request("ok", prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    broken = engine.add_request("bad", prompts[1], SamplingParams(max_tokens=8, structured_output=bad))
    deltas = []
    while engine.has_work():
        deltas.extend(engine.step())
    errors = [d for d in deltas if d.request_id == "bad"]
    assert len(errors) == 1 and errors[0].finish_reason == "error" and errors[0].token_ids == []
    assert isinstance(errors[0].error, StructuredOutputError) and errors[0].error.param == "response_format"
    assert broken.finish_reason == "error" and ok.finish_reason == "length" and ok.num_output_tokens == 8
    assert_pool_idle(engine.block_manager)
    with pytest.raises(StructuredOutputError, match="invalid JSON schema"):
        tiny_llm.generate(prompts[1], SamplingParams(max_tokens=4, structured_output=bad))
    assert not tiny_llm.engine.has_work()


def test_reasoning_runs_free_and_the_grammar_constrains_the_answer(tiny_model) -> None:
    """On a vocabulary with single-token <think> and </think> (tiny qwen3), a prompt that opens the reasoning lets
    the output close it (a logit bias pushes </think>), then the answer follows the grammar; with
    reasoning=False the grammar applies from the first token, so </think> cannot come."""
    llm = LLM(str(tiny_model("qwen3", "F32").path), device="cpu", dtype="float32")
    tok = llm.tokenizer
    open_id, close_id = reasoning_token_ids(tok)
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert open_id in prompt[-2:]
    bias = {close_id: 100.0}
    answer = r"(yes|no)"
    gated = SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias,
                           structured_output=StructuredOutput(regex=answer))
    out = llm.generate([prompt], gated)[0]
    assert out.token_ids[0] == close_id and out.finish_reason == "stop"
    assert out.text in ("</think>yes", "</think>no"), out.text
    strict = SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias,
                            structured_output=StructuredOutput(regex=answer, reasoning=False))
    out = llm.generate([prompt], strict)[0]
    assert close_id not in out.token_ids and out.text in ("yes", "no") and out.finish_reason == "stop"


def test_sampling_params_field() -> None:
    """`structured_output` takes a StructuredOutput or a dict of its fields; anything else is a ValueError."""
    p = SamplingParams(structured_output={"json_schema": PERSON})
    assert p.structured_output == StructuredOutput(json_schema=PERSON)
    for bad in ("json", {"jsonschema": {}}, 3):
        with pytest.raises(ValueError, match="structured_output"):
            SamplingParams(structured_output=bad)
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        SamplingParams(structured_output={"json_schema": {"type": "wrong"}})


def test_the_engine_imports_no_grammar_engine_until_a_request_needs_one(tiny_model) -> None:
    """Loading a model and generating free text leaves llguidance unimported."""
    path = tiny_model("llama", "F32").path
    code = ("import sys; from gpullama import LLM, SamplingParams; import gpullama.server.app; "
            f"LLM({str(path)!r}, device='cpu').generate('hi', SamplingParams(max_tokens=2)); "
            "assert 'llguidance' not in sys.modules, 'llguidance imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_gate_follows_the_specs_reasoning_tags(tmp_path_factory) -> None:
    """On a vocabulary with Gemma 4's ``<|channel>`` and ``<channel|>`` as single tokens (a tiny qwen2), a spec
    with Gemma's tags lets the output open its block (``<|channel>``, pushed by a logit bias) and close it before
    the grammar; with the default ``<think>`` tags the grammar applies from the first token. A prompt that ends
    with the whole open tag (``<|channel>thought``) starts inside the block."""
    from tests.fixtures.tiny_models import build_tiny_model

    path = build_tiny_model("qwen2", tmp_path_factory.mktemp("markers"), vocab="qwen2-markers").path
    llm = LLM(str(path), device="cpu", dtype="float32")
    tok = llm.tokenizer
    open_id, close_id = reasoning_token_ids(tok, "<|channel>thought", "<channel|>")
    assert (open_id, close_id) == (tok._tokens.index("<|channel>"), tok._tokens.index("<channel|>"))
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    bias = {open_id: 50.0, close_id: 100.0}  # open when allowed, then close at once
    gemma = StructuredOutput(regex=r"(yes|no)", reasoning_tags=("<|channel>thought", "<channel|>"))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias,
                                                structured_output=gemma))[0]
    assert out.token_ids[:2] == [open_id, close_id] and out.finish_reason == "stop", out.token_ids
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias,
                                                structured_output=StructuredOutput(regex=r"(yes|no)")))[0]
    assert open_id not in out.token_ids and close_id not in out.token_ids and out.finish_reason == "stop"
    opened = prompt + tok.encode("<|channel>thought\n")
    out = llm.generate([opened], SamplingParams(temperature=0.0, max_tokens=10, logit_bias={close_id: 100.0},
                                                structured_output=gemma))[0]
    assert out.token_ids[0] == close_id and out.finish_reason == "stop", out.token_ids
