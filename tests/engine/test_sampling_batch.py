"""Sampling is per sequence inside a batch: seeds, temperatures, filters, penalties, stops and logprobs don't leak."""

from __future__ import annotations

import torch

from gpullama import LLM
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_requests, solo_runs

TINY_VOCAB, TINY_BOS = 700, 700


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    """Random tiny-vocabulary prompts of the given lengths, each starting with BOS."""
    gen = torch.Generator().manual_seed(seed)
    return [random_prompt(gen, n, TINY_VOCAB, TINY_BOS) for n in lengths]


def batch_engine(llm: LLM):
    """A batching engine with a small step budget (so prompts are chunked and steps mix prefill with decode)."""
    return make_engine(llm, max_num_seqs=16, max_num_batched_tokens=48)


def test_same_seed_same_params_give_identical_outputs_equal_to_solo(tiny_llm: LLM) -> None:
    """Two requests with the same prompt, seed and params in one batch sample the same tokens, which are the tokens
    the request samples alone; the same request with another seed samples differently."""
    prompt = prompts_of([25], seed=1)[0]
    others = prompts_of([60, 7, 33], seed=2)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    reseeded = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=20, ignore_eos=True)
    noise = [SamplingParams(temperature=0.8, seed=s, max_tokens=12) for s in (1, 2, 3)]
    prompts = [prompt, others[0], prompt, others[1], prompt, others[2]]
    params = [seeded, noise[0], seeded, noise[1], reseeded, noise[2]]
    got = run_requests(batch_engine(tiny_llm), prompts, params)
    want = solo_runs(tiny_llm, [prompt, prompt], [seeded, reseeded])
    assert got[0].output_token_ids == got[2].output_token_ids == want[0].output_token_ids
    assert got[4].output_token_ids == want[1].output_token_ids
    assert got[4].output_token_ids != got[0].output_token_ids, "the seed made no difference"


def test_mixed_sampling_params_do_not_leak_between_sequences(tiny_llm: LLM) -> None:
    """Greedy, temperature, top-k, top-p, min-p, penalties and logit bias side by side: each request's tokens are
    the ones it gets alone."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=2, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.9, presence_penalty=1.5, frequency_penalty=0.7, seed=3, max_tokens=14),
        SamplingParams(temperature=0.0, logit_bias={17: 8.0, 42: 6.0}, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.9, seed=4, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, max_tokens=14, ignore_eos=True),
    ]
    prompts = prompts_of([12, 70, 33, 5, 90, 20, 41, 55], seed=3)
    got = run_requests(batch_engine(tiny_llm), prompts, params)
    want = solo_runs(tiny_llm, prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.output_token_ids == w.output_token_ids, f"request {i} ({params[i]}) differs from its solo run"
    # the biased request really is steered, and the penalised greedy one really differs from plain greedy
    assert {17, 42} & set(got[5].output_token_ids)
    plain = solo_runs(tiny_llm, [prompts[3]], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))[0]
    assert got[3].output_token_ids != plain.output_token_ids


def test_stop_strings_and_stop_token_ids_end_only_their_sequence(tiny_llm: LLM) -> None:
    """A stop string cuts one request's text right before it, a stop token id ends another after that token; the
    other requests in the batch run to their solo outputs."""
    prompts = prompts_of([30, 45, 18, 64], seed=4)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    solo = solo_runs(tiny_llm, prompts, free)
    # a stop string: two ASCII letters taken from the middle of request 0's solo text
    text = solo[0].text
    start = next(i for i in range(4, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isalpha())
    stop = text[start : start + 2]
    # a stop token: request 1's sixth solo token
    stop_token = solo[1].output_token_ids[5]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_token]),
        free,
        free,
    ]
    got = run_requests(batch_engine(tiny_llm), prompts, params)
    assert got[0].finish_reason == "stop"
    assert got[0].text == text[: text.find(stop)]
    assert got[0].output_token_ids == solo[0].output_token_ids[: got[0].num_output_tokens]
    cut = solo[1].output_token_ids.index(stop_token) + 1
    assert got[1].finish_reason == "stop"
    assert got[1].output_token_ids == solo[1].output_token_ids[:cut]
    for i in (2, 3):
        assert got[i].output_token_ids == solo[i].output_token_ids and got[i].finish_reason == "length"
        assert got[i].text == solo[i].text


def test_logprobs_in_a_batch_match_the_solo_log_softmax(tiny_llm: LLM) -> None:
    """Requested logprobs of a batched sequence equal log-softmax of its own solo logits (others ask for none)."""
    prompts = prompts_of([22, 80, 9], seed=5)
    want_lp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    plain = SamplingParams(temperature=0.7, seed=5, max_tokens=8, ignore_eos=True)
    got = run_requests(batch_engine(tiny_llm), prompts, [plain, want_lp, plain])
    seq = got[1]
    assert got[0].logprobs is None and len(seq.logprobs) == 8
    logits = tiny_llm.logits(seq.token_ids)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for step, entry in enumerate(seq.logprobs):
        row = reference[seq.num_prompt_tokens - 1 + step]
        assert entry.token_id == seq.output_token_ids[step]
        assert abs(entry.logprob - row[entry.token_id].item()) < 1e-4
        top = torch.topk(row, 3)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        assert all(abs(t.logprob - v) < 1e-4 for t, v in zip(entry.top, top.values.tolist()))


def test_processed_logprobs_are_the_distribution_each_row_is_drawn_from(tiny_llm: LLM) -> None:
    """`logprobs_mode="processed_logprobs"` (llama.cpp's post_sampling_probs): the log of the distribution after
    temperature, top-k and top-p, in a batch with a raw-logprobs request; greedy puts all of it on the argmax."""
    from gpullama.engine.sampler import warped_probs

    prompts = prompts_of([15, 31], seed=6)
    prompts.append(prompts[1])
    sampled = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=8,
                             logprobs_mode="processed_logprobs")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4,
                            logprobs_mode="processed_logprobs")
    raw = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4)
    got = run_requests(batch_engine(tiny_llm), prompts, [sampled, greedy, raw])
    seq = got[0]
    logits = tiny_llm.logits(seq.token_ids)
    for step, entry in enumerate(seq.logprobs):
        want = warped_probs(logits[seq.num_prompt_tokens - 1 + step][None], 0.8, 5, 0.9, 0.0)[0].double()
        kept = int((want > 0).sum())
        assert 1 <= kept <= 5 and abs(entry.logprob - want[entry.token_id].log().item()) < 1e-4
        finite = [t for t in entry.top if t.logprob > float("-inf")]
        assert len(finite) == kept and abs(sum(torch.tensor([t.logprob for t in finite]).exp()).item() - 1) < 1e-4
    for entry in got[1].logprobs:
        assert entry.logprob == 0.0 and entry.top[0].token_id == entry.token_id
        assert all(t.logprob == float("-inf") for t in entry.top[1:])
    assert got[1].output_token_ids == got[2].output_token_ids and got[2].logprobs[0].top[1].logprob > float("-inf")
