"""Prefix caching: shared prefixes are served from cached blocks with unchanged outputs, and nothing leaks."""

from __future__ import annotations

import pytest
import torch

import gpullama.engine.block_manager as block_manager
from gpullama import LLM
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import PASSAGE, assert_pool_idle, make_engine, random_prompt, run_requests, solo_runs

TINY_VOCAB, TINY_BOS = 700, 700
BLOCK = 16


@pytest.mark.slow
def test_second_request_with_300_token_prefix_is_served_from_cache(real_llm: LLM) -> None:
    """SmolLM2: a second prompt sharing a 300-token prefix reports 288 cached tokens (18 full blocks) and gives the
    tokens it gives with the cache off."""
    tok = real_llm.tokenizer
    prefix = tok.encode("Prefix cache check. " + PASSAGE, add_special_tokens=True)[:300]
    assert len(prefix) == 300
    first = prefix + tok.encode(" What did the last keeper say about his first night?", add_special_tokens=False)
    second = prefix + tok.encode(" Where are the logbooks kept now?", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    a = real_llm.generate(first, params)[0]
    b = real_llm.generate(second, params)[0]
    assert a.num_cached_tokens == 0
    # every full block of the shared prefix, and no more (block 19 mixes prefix and the first prompt's suffix)
    assert b.num_cached_tokens == BLOCK * (300 // BLOCK)
    want = solo_runs(real_llm, [second], params)[0]
    assert b.token_ids == want.output_token_ids and b.text == want.text
    assert_pool_idle(real_llm.engine.block_manager)


def test_repeated_prompt_reuses_all_full_blocks_but_the_last_token(tiny_llm: LLM) -> None:
    """A prompt seen before is cached up to the last full block before its final token (which is recomputed)."""
    gen = torch.Generator().manual_seed(5)
    prompts = [random_prompt(gen, n, TINY_VOCAB, TINY_BOS) for n in (64, 70, 15)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = make_engine(tiny_llm, max_num_batched_tokens=64)
    first = run_requests(engine, prompts, params)
    second = run_requests(engine, prompts, params)
    assert [s.num_cached_tokens for s in first] == [0, 0, 0]
    assert [s.num_cached_tokens for s in second] == [BLOCK * ((n - 1) // BLOCK) for n in (64, 70, 15)]
    want = solo_runs(tiny_llm, prompts, params)
    for got_a, got_b, ref in zip(first, second, want):
        assert got_a.output_token_ids == ref.output_token_ids == got_b.output_token_ids
    assert_pool_idle(engine.block_manager)


def test_no_leak_after_200_requests(tiny_llm: LLM) -> None:
    """200 requests over six shared prefixes through a 40-block pool (LRU eviction), five aborted mid-flight:
    afterwards every block is free, the hash map is consistent, and sampled outputs equal the solo runs."""
    gen = torch.Generator().manual_seed(11)
    prefixes = [random_prompt(gen, n, TINY_VOCAB, TINY_BOS) for n in (20, 33, 48, 64, 90, 120)]
    prompts, params = [], []
    for i in range(200):
        suffix = random_prompt(gen, int(torch.randint(0, 20, (1,), generator=gen)), TINY_VOCAB)
        prompts.append(prefixes[i % 6] + suffix)
        params.append(SamplingParams(temperature=0.0, max_tokens=1 + i % 10, ignore_eos=i % 3 == 0))
    engine = make_engine(tiny_llm, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=64)
    bm = engine.block_manager
    finished = []
    for wave in range(5):
        lo, hi = 40 * wave, 40 * (wave + 1)
        if wave == 2:  # abort five requests after a few steps, some running and some still waiting
            seqs = [engine.add_request(f"leak-{i}", prompts[i], params[i]) for i in range(lo, hi)]
            for _ in range(3):
                engine.step()
            for i in (lo, lo + 3, lo + 9, lo + 20, lo + 39):
                engine.abort(f"leak-{i}")
            while engine.has_work():
                engine.step()
            finished += seqs
        else:
            finished += run_requests(engine, prompts[lo:hi], params[lo:hi])
        assert_pool_idle(bm)
    assert sum(s.num_cached_tokens for s in finished) > 0, "no request was served from the prefix cache"
    assert all(s.num_cached_tokens % BLOCK == 0 for s in finished)
    sample = list(range(0, 200, 9))
    want = solo_runs(tiny_llm, [prompts[i] for i in sample], [params[i] for i in sample])
    for i, ref in zip(sample, want):
        if finished[i].finish_reason != "abort":
            assert finished[i].output_token_ids == ref.output_token_ids, f"request {i} differs from its solo run"


def test_hash_collisions_never_serve_wrong_blocks(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every block key colliding, a hit must still only serve blocks whose whole prefix matches: a prompt that
    repeats its first block, and unrelated prompts, keep their solo outputs."""
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, token_ids: 0)
    gen = torch.Generator().manual_seed(3)
    a = random_prompt(gen, BLOCK, TINY_VOCAB, TINY_BOS)
    prompts = [
        a + random_prompt(gen, 20, TINY_VOCAB),
        a + a + random_prompt(gen, 5, TINY_VOCAB),  # block 1 has block 0's ids at another position
        random_prompt(gen, 40, TINY_VOCAB, TINY_BOS),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = make_engine(tiny_llm, max_num_seqs=1)
    got = run_requests(engine, prompts, params)
    want = solo_runs(tiny_llm, prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.output_token_ids == w.output_token_ids, f"prompt {i}: cached blocks changed the output"
    assert_pool_idle(engine.block_manager)
