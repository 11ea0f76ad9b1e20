"""Preemption under a tiny KV pool, aborts mid-flight, and the up-front rejection of requests that can never fit."""

from __future__ import annotations

import pytest
import torch

from gpullama import LLM
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import assert_pool_idle, make_engine, random_prompt, run_requests, solo_runs

TINY_VOCAB, TINY_BOS = 700, 700
TINY_CONTEXT = 256
BLOCK = 16


def kv_block_bytes(llm: LLM) -> int:
    """Bytes of one float32 KV block (k and v of every layer) of `llm`'s model."""
    c = llm.config
    return 2 * c.num_layers * BLOCK * c.num_kv_heads * c.head_dim * 4


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    """Random tiny-vocabulary prompts of the given lengths, each starting with BOS."""
    gen = torch.Generator().manual_seed(seed)
    return [random_prompt(gen, n, TINY_VOCAB, TINY_BOS) for n in lengths]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tiny_pool_preempts_and_still_matches_solo(tiny_model, tiny_llm: LLM, prefix_caching: bool) -> None:
    """A 12-block pool (192 tokens) for 8 requests of up to 100 tokens each: the engine preempts, recomputes and
    finishes every request with its solo greedy output."""
    llm = LLM(
        str(tiny_model("llama", "F32").path),
        device="cpu",
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=12 * kv_block_bytes(tiny_llm),
        max_num_batched_tokens=64,
        enable_prefix_caching=prefix_caching,
    )
    assert llm.engine.block_manager.num_blocks == 12
    prompts = prompts_of([30, 41, 52, 60, 35, 47, 58, 33], seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    completions = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    want = solo_runs(tiny_llm, prompts, params)
    for i, (c, w) in enumerate(zip(completions, want)):
        assert c.finish_reason == "length"
        assert c.token_ids == w.output_token_ids, f"request {i} changed after preemption"
        assert c.text == w.text
    assert_pool_idle(llm.engine.block_manager)


def test_abort_mid_flight_frees_blocks_and_spares_the_others(tiny_llm: LLM) -> None:
    """Aborting running and waiting requests frees their blocks at once; the rest finish as if run alone; every
    aborted request gets a last delta with finish_reason "abort"."""
    prompts = prompts_of([20, 75, 33, 90, 12, 64, 50, 18, 100, 41], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(tiny_llm, max_num_seqs=6, max_num_batched_tokens=64)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for _ in range(4):
        engine.step()
    running = [s.request_id for s in engine.scheduler.running]
    waiting = [s.request_id for s in engine.scheduler.waiting]
    assert running and waiting
    aborted = running[::2] + waiting[:1]
    held_before = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    held_by_aborted = sum(len(s.block_table) for s in seqs if s.request_id in aborted)
    assert held_by_aborted > 0
    for rid in aborted:
        engine.abort(rid)
    held_after = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert held_after == held_before - held_by_aborted, "abort did not free the request's blocks at once"
    last: dict[str, object] = {}
    while engine.has_work():
        for delta in engine.step():
            last[delta.request_id] = delta
    for rid in aborted:
        assert last[rid].finish_reason == "abort", f"{rid}: its last delta says {last[rid].finish_reason!r}"
    kept = [(s, p) for s, p in zip(seqs, prompts) if s.request_id not in aborted]
    want = solo_runs(tiny_llm, [p for _, p in kept], params)
    for (s, _), w in zip(kept, want):
        assert s.finish_reason == "length" and s.output_token_ids == w.output_token_ids, s.request_id
    assert all(s.finish_reason == "abort" for s in seqs if s.request_id in aborted)
    assert_pool_idle(engine.block_manager)


def test_generate_rejects_prompt_longer_than_context_at_once(tiny_llm: LLM) -> None:
    """A prompt over the context raises ValueError naming its length and the limit, and queues nothing, not even
    the valid prompts given with it."""
    ok, too_long = prompts_of([10, 300], seed=1)
    with pytest.raises(ValueError) as err:
        tiny_llm.generate([ok, too_long], SamplingParams(max_tokens=4))
    assert "300" in str(err.value) and str(TINY_CONTEXT) in str(err.value)
    assert not tiny_llm.engine.has_work()
    assert_pool_idle(tiny_llm.engine.block_manager)
    with pytest.raises(ValueError, match=str(TINY_CONTEXT)):  # a prompt filling the whole context leaves no room
        tiny_llm.generate(prompts_of([TINY_CONTEXT], seed=2), SamplingParams(max_tokens=1))


def test_max_tokens_beyond_context_names_both_numbers(tiny_llm: LLM) -> None:
    """prompt + max_tokens over the context: ValueError naming the prompt length, max_tokens and the context."""
    prompt = prompts_of([100], seed=4)[0]
    with pytest.raises(ValueError) as err:
        tiny_llm.generate(prompt, SamplingParams(max_tokens=200))
    message = str(err.value)
    for number in ("100", "200", str(TINY_CONTEXT)):
        assert number in message, f"{number} missing from: {message}"
    assert not tiny_llm.engine.has_work()
    # right at the limit it runs (and stops for length there)
    done = tiny_llm.generate(prompt, SamplingParams(max_tokens=TINY_CONTEXT - 100, temperature=0.0, ignore_eos=True))
    assert len(done[0].token_ids) == TINY_CONTEXT - 100 and done[0].finish_reason == "length"


def test_request_larger_than_the_pool_is_rejected(tiny_llm: LLM) -> None:
    """An engine whose pool (4 blocks, 64 tokens) is smaller than a request rejects it up front, naming both sizes."""
    engine = make_engine(tiny_llm, num_blocks=4)
    with pytest.raises(ValueError) as err:
        engine.add_request("big", prompts_of([60], seed=6)[0], SamplingParams(max_tokens=10))
    assert "70" in str(err.value) and "64" in str(err.value)
    assert not engine.has_work()
    run_requests(engine, prompts_of([40], seed=6), SamplingParams(max_tokens=10))  # one that fits still runs
    assert_pool_idle(engine.block_manager)
