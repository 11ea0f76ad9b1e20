"""Isolation as a property: when a step fails because of one request, that request alone ends (finish reason
"error", its blocks freed) and every other request in the batch gets exactly the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch

import gpullama.engine.sampler as sampler
from gpullama import LLM
from gpullama.engine.async_engine import EngineError
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import assert_pool_idle, make_engine, random_prompt, run_requests, solo_runs

TINY_VOCAB, TINY_BOS = 700, 700
POISON = [TINY_BOS, 5, 5, 5, 5, 5, 5, 5, 5, 9]  # the prompt whose sampling (or forward) is made to fail

# greedy and seeded draws, with and without penalties: a re-run must rewind the generators and repeat the penalties
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, seed=8, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.2, seed=9, presence_penalty=0.5, logit_bias={3: 2.0}, max_tokens=12,
                   ignore_eos=True),
    SamplingParams(temperature=0.0, frequency_penalty=1.0, max_tokens=12, ignore_eos=True),
]
POISON_TEMPERATURE = 0.77  # how the sampling kernel's fault finds the poisoned row among plain tensors
POISON_PARAMS = SamplingParams(temperature=POISON_TEMPERATURE, seed=3, repetition_penalty=1.1, max_tokens=12,
                               ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [random_prompt(gen, n, TINY_VOCAB, TINY_BOS) for n in (40, 9, 70, 23, 31)]


def _is_poison(seq) -> bool:
    return seq.prompt_token_ids == POISON


def _check_isolated(llm: LLM, engine, after_tokens: int) -> None:
    prompts = _prompts()
    got = run_requests(engine, [*prompts[:2], POISON, *prompts[2:]], [*PARAMS[:2], POISON_PARAMS, *PARAMS[2:]])
    poisoned = got.pop(2)
    assert poisoned.finish_reason == "error" and "injected fault" in str(poisoned.error)
    assert poisoned.num_output_tokens == after_tokens  # it failed at the step where the fault was armed
    want = solo_runs(llm, prompts, PARAMS)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.finish_reason == "length"
        assert g.output_token_ids == w.output_token_ids, f"request {i} differs from its solo run"
        assert g.text == w.text
    assert not engine.has_work()
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("after_tokens", [0, 4])
def test_a_fault_in_one_sequences_sampling_fails_it_alone(tiny_llm: LLM, monkeypatch, after_tokens: int) -> None:
    real = sampler.apply_penalties

    def apply_penalties(logits, seq):  # raises for the poisoned row, as an out-of-range bias index did
        if _is_poison(seq) and seq.num_output_tokens >= after_tokens:
            raise IndexError("injected fault in one row's penalties")
        return real(logits, seq)

    monkeypatch.setattr(sampler, "apply_penalties", apply_penalties)
    # a small step budget: prompts are chunked, so failing steps mix prefill chunks with decodes
    _check_isolated(tiny_llm, make_engine(tiny_llm, max_num_seqs=16, max_num_batched_tokens=48), after_tokens)


@pytest.mark.parametrize("static_decode", [False, True])
def test_a_fault_in_the_sampling_kernel_fails_that_row_alone(tiny_llm: LLM, monkeypatch, static_decode: bool) -> None:
    """The kernel runs after every row drew its random number: the re-runs must rewind the seeded generators. With
    `static_decode` (the CUDA-graph path) each re-run's logits come from the runner's static buffers."""
    engine = make_engine(tiny_llm, max_num_seqs=16, max_num_batched_tokens=48, static_decode=static_decode)
    ops = engine.model.ops
    real = ops.sample
    poisoned_calls = []

    def sample(logits, temperature, *rest):  # from the poisoned row's 7th token on (decode steps by then)
        if bool((temperature == POISON_TEMPERATURE).any()):
            poisoned_calls.append(len(temperature))
            if len(poisoned_calls) > 6:
                raise RuntimeError("injected fault in the sampling kernel")
        return real(logits, temperature, *rest)

    monkeypatch.setattr(ops, "sample", sample)
    _check_isolated(tiny_llm, engine, after_tokens=6)
    assert poisoned_calls[6] > 1  # the first failing call held other rows too


def test_a_fault_in_the_forward_of_one_sequence_fails_it_alone(tiny_llm: LLM, monkeypatch) -> None:
    engine = make_engine(tiny_llm, max_num_seqs=16, max_num_batched_tokens=48)
    real = engine.runner.execute

    def execute(batch):  # the forward of any batch that holds the poisoned row (past its first token) raises
        if any(_is_poison(seq) and seq.num_output_tokens >= 2 for seq in batch.seqs):
            raise RuntimeError("injected fault in the forward")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    _check_isolated(tiny_llm, engine, after_tokens=2)


def test_the_library_reports_the_failed_request_and_finishes_the_others(tiny_llm: LLM, monkeypatch) -> None:
    real = sampler.sample_batch

    def sample_batch(logits, seqs, ops):  # a whole-batch failure whenever the poisoned row is in it
        if any(_is_poison(s) for s in seqs):
            raise RuntimeError("injected fault in the batched sampling")
        return real(logits, seqs, ops)

    monkeypatch.setattr("gpullama.engine.llm_engine.sample_batch", sample_batch)
    prompts = _prompts()[:2]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = tiny_llm.generate([prompts[0], POISON, prompts[1]], greedy)
    assert [c.finish_reason for c in out] == ["length", "error", "length"]
    assert "injected fault" in out[1].error and out[1].token_ids == []
    assert [c.token_ids for c in (out[0], out[2])] == [c.token_ids for c in tiny_llm.generate(prompts, greedy)]
    with pytest.raises(EngineError, match="injected fault"):
        list(tiny_llm.stream(POISON, greedy))
    assert tiny_llm.generate(prompts[0], greedy)[0].token_ids == out[0].token_ids  # the engine goes on
