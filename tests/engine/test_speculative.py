"""n-gram speculative decoding: greedy output is exactly plain decoding's (alone, batched, with stop strings,
logprobs, limits and grammar rows beside it; on the exact path and the CPU fast path), and sampled output keeps
plain sampling's distribution (chi-square against the exact probabilities)."""

from __future__ import annotations

import argparse

import pytest
import torch

from gpullama import LLM
from gpullama.engine.args import EngineArgs, SpeculativeConfig
from gpullama.engine.ngram_proposer import NgramProposer, TokenBuffer
from gpullama.engine.sampler import verify_drafts, warped_probs
from gpullama.engine.sequence import Sequence
from gpullama.ops import TorchOps
from gpullama.sampling_params import SamplingParams
from gpullama.structured.spec import StructuredOutput
from tests.engine.helpers import assert_pool_idle, make_engine, random_prompt, run_requests

TINY_VOCAB = 700
TINY_BOS = 700
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
LOGPROB_TOLERANCE = 1e-4  # |speculative - plain| of a reported logprob (float32; a chunk row against a decode row)
P_VALUE_FLOOR = 1e-3  # the chi-square tests are seeded: a fixed draw that fails this is a real bias


def repeat_prompts(seed: int = 3) -> list[list[int]]:
    """Prompts whose text repeats (a random segment two to five times, cut short), and two that do not."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for n, reps in ((12, 3), (30, 2), (7, 5), (20, 3), (45, 2)):
        segment = random_prompt(gen, n, TINY_VOCAB)
        prompts.append([TINY_BOS] + segment * reps + segment[: n // 2])
    prompts += [random_prompt(gen, n, TINY_VOCAB, TINY_BOS) for n in (9, 60)]
    return prompts


def assert_same(got: list[Sequence], want: list[Sequence]) -> None:
    """Same tokens, text, finish and stop reason, token counts and logprobs (tokens exact, values within
    LOGPROB_TOLERANCE)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.output_token_ids == w.output_token_ids, f"request {i}: {g.output_token_ids} != {w.output_token_ids}"
        assert g.text == w.text, f"request {i}: text differs"
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason), f"request {i}"
        assert g.num_output_tokens == w.num_output_tokens and g.num_prompt_tokens == w.num_prompt_tokens
        if w.logprobs is None:
            assert g.logprobs is None
            continue
        assert len(g.logprobs) == len(w.logprobs) == w.num_output_tokens
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < LOGPROB_TOLERANCE
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


# -- the config and the proposer --------------------------------------------------------------------------


def test_config_is_read_as_vllm_spells_it() -> None:
    """LLM-argument dicts and the --speculative-config JSON give the same config; mistakes name the key."""
    given = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}
    args = EngineArgs(speculative_config=given)
    assert args.speculative_config == SpeculativeConfig("ngram", 5, 3, 2)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}']))
    assert parsed.speculative_config == args.speculative_config
    assert EngineArgs().speculative_config is None
    assert SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_max": 1}).prompt_lookup_min == 1
    for bad, words in (({"method": "eagle"}, "method"), ({"method": "ngram", "k": 2}, "unknown key"),
                       ({"num_speculative_tokens": 2}, "needs \"method\""),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
                       ("{not json", "not valid JSON"), ([1], "JSON object")):
        with pytest.raises(ValueError, match=words):
            EngineArgs(speculative_config=bad)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram", "bogus": 1}'])


def reference_lookup(ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup by brute force: the longest n whose suffix occurs earlier, its latest occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + k]
    return []


def test_proposer_matches_brute_force_lookup() -> None:
    gen = torch.Generator().manual_seed(0)
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2))
    for trial in range(300):
        ids = torch.randint(0, 4 if trial % 2 else 12, (int(torch.randint(1, 40, (), generator=gen)),),
                            generator=gen).tolist()
        assert proposer.propose(ids, 10) == reference_lookup(ids, 2, 4, 3), ids
    buffer, grown = TokenBuffer(), []
    for token in torch.randint(0, 5, (700,), generator=gen).tolist():  # past the buffer's first 256 entries
        grown.append(token)
        assert proposer.propose(buffer.view(grown), 10) == reference_lookup(grown, 2, 4, 3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], 10) == [9, 1, 2]
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], 1) == [9]  # the room left (max_tokens, context) caps it
    assert proposer.propose([5, 6, 7, 8], 10) == []


# -- greedy: exactly plain decoding -------------------------------------------------------------------------


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_greedy_output_is_plain_decoding(tiny_llm: LLM, max_num_seqs: int) -> None:
    """Alone and in a continuous batch (chunked prefill beside draft checks): every request's tokens, text,
    finish, counts and logprobs equal plain decoding's, drafts were both accepted and rejected, and the pool ends
    idle."""
    prompts = repeat_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=(40, 3, 25, 1, 33, 17, 40)[i], ignore_eos=i % 2 == 0,
                             logprobs=2 if i % 3 == 0 else None) for i in range(len(prompts))]
    plain = run_requests(make_engine(tiny_llm, max_num_seqs=max_num_seqs, max_num_batched_tokens=48), prompts, params)
    engine = make_engine(tiny_llm, max_num_seqs=max_num_seqs, max_num_batched_tokens=48, speculative=SPEC)
    spec = run_requests(engine, prompts, params)
    assert_same(spec, plain)
    stats = engine.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, (stats.accepted_tokens, stats.draft_tokens)
    assert stats.generation_tokens == sum(s.num_output_tokens for s in spec)
    assert engine.stats.steps < make_engine_steps(tiny_llm, prompts, params, max_num_seqs)
    assert_pool_idle(engine.block_manager)


def make_engine_steps(llm: LLM, prompts, params, max_num_seqs: int) -> int:
    engine = make_engine(llm, max_num_seqs=max_num_seqs, max_num_batched_tokens=48)
    run_requests(engine, prompts, params)
    return engine.stats.steps


def test_stop_strings_tokens_and_context_limit_end_where_plain_decoding_ends(tiny_llm: LLM) -> None:
    """A stop string met inside an accepted run of drafts, stop token ids, and the context limit end the request
    at the same token as plain decoding (later accepted tokens are dropped)."""
    prompts = repeat_prompts(seed=8)[:5]
    free = run_requests(make_engine(tiny_llm), prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                                       ignore_eos=True))
    params = []
    for i, seq in enumerate(free):
        text, ids = seq.text, seq.output_token_ids
        if i % 2 == 0 and len(text) > 20:
            params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[text[12:16]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[-5]]))
    plain = run_requests(make_engine(tiny_llm), prompts, params)
    assert any(s.stop_reason is not None for s in plain)
    assert_same(run_requests(make_engine(tiny_llm, speculative=SPEC), prompts, params), plain)
    # the context limit: 128 tokens, the longest prompt has 113
    limit = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    plain = run_requests(make_engine(tiny_llm, max_model_len=128), prompts, limit)
    engine = make_engine(tiny_llm, max_model_len=128, speculative=SPEC)
    spec = run_requests(engine, prompts, limit)
    assert_same(spec, plain)
    assert all(s.finish_reason == "length" and s.num_tokens == 128 for s in spec)
    assert_pool_idle(engine.block_manager)


def test_grammar_and_penalised_rows_beside_drafting_ones(tiny_llm: LLM) -> None:
    """Constrained and penalised requests decode one token a step in a batch whose other rows draft: the free
    rows equal plain decoding, the constrained text matches its regex, the penalised row equals its plain run."""
    prompts = repeat_prompts(seed=4)[:4]
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3)
    constrained = SamplingParams(temperature=0.0, max_tokens=30, structured_output=StructuredOutput(
        regex="[0-9]{3,20}"))
    params = [free, constrained, penalised, free]
    plain = run_requests(make_engine(tiny_llm), prompts, params)
    engine = make_engine(tiny_llm, speculative=SPEC)
    spec = run_requests(engine, prompts, params)
    for i in (0, 2, 3):
        assert_same([spec[i]], [plain[i]])
    assert spec[1].text.isdigit() and 3 <= len(spec[1].text) <= 20, spec[1].text
    assert engine.stats.accepted_tokens > 0
    assert_pool_idle(engine.block_manager)


CODE_PROMPT = """Rename the variable `total` to `running_sum` in this function and return the whole function.

```python
def add_all(values):
    total = 0
    for value in values:
        if value is None:
            continue
        total = total + value
    return total
```
"""


def test_fast_path_greedy_output_is_plain_decoding(fast_default_llm: LLM) -> None:
    """SmolLM2 Q4_1 on the CPU fast path: a code-edit chat decodes to the same tokens with drafts checked as a
    chunk, alone and batched with a free-text request."""
    llm = fast_default_llm
    prompts = [llm._encode_chat([{"role": "user", "content": CODE_PROMPT}]),
               llm._encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = run_requests(make_engine(llm, max_num_seqs=2), prompts, params)
    spec_config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    engine = make_engine(llm, max_num_seqs=2, speculative=spec_config)
    assert_same(run_requests(engine, prompts, params), plain)
    alone = make_engine(llm, max_num_seqs=1, speculative=spec_config)
    assert_same(run_requests(alone, prompts[:1], params), plain[:1])
    assert alone.stats.accepted_tokens > 0, alone.stats


CODE_EDITS = [
    CODE_PROMPT,
    """Add a parameter `skip_negative=False` to this function: when it is true, negative values are left out.
Return the whole function.

```python
def count_items(items, limit):
    seen = 0
    for item in items:
        if seen >= limit:
            break
        seen += 1
    return seen
```
""",
    """Add a one-line docstring to this function and return the whole function unchanged otherwise.

```python
def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value
```
""",
]
"""Code edits whose answer copies most of the prompt: rename a variable, add a parameter, add a docstring."""


def test_real_coder_code_edits_decode_as_plain(coder_model_path) -> None:
    """The real Qwen2.5-Coder-0.5B Q4_K_M (the model speculation is for) on the CPU fast path: each code edit, alone,
    decodes to plain decoding's tokens with n-gram drafts, and the drafts carry a good part of the output (the edits
copy the prompt's code: 36% of the tokens were accepted drafts when this was written)."""
    llm = LLM(str(coder_model_path), device="cpu", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    spec_config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    plain_engine = make_engine(llm, max_num_seqs=1)
    spec_engine = make_engine(llm, max_num_seqs=1, speculative=spec_config)
    for edit in CODE_EDITS:
        prompt = [llm._encode_chat([{"role": "user", "content": edit}])]
        assert_same(run_requests(spec_engine, prompt, params), run_requests(plain_engine, prompt, params))
    stats = spec_engine.stats
    assert stats.accepted_tokens >= stats.generation_tokens // 4, stats


# -- sampled: plain sampling's distribution -------------------------------------------------------------------


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs` (outcomes of probability 0 must never occur)."""
    n = counts.sum()
    assert bool((counts[probs == 0] == 0).all()), "an outcome of probability 0 occurred"
    live = probs > 0
    expected = probs[live] * n
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "draft"), [
    (1.0, 0, 1.0, 2),  # a likely draft
    (1.0, 0, 1.0, 5),  # an unlikely one
    (0.7, 3, 0.9, 1),  # a draft inside the kept set
    (0.7, 3, 0.9, 4),  # outside it: always rejected
])
def test_sampled_drafts_keep_the_distribution(temperature: float, top_k: int, top_p: float, draft: int) -> None:
    """Rejection sampling of one point-mass draft over a 6-token vocabulary: the first token follows p0, and after
    an accepted draft the bonus token follows p1 (the joint law of plain sampling two tokens)."""
    logits = torch.tensor([[1.0, 0.3, 2.0, -0.5, 0.8, -2.0],
                           [0.2, 1.5, -1.0, 0.9, 0.0, 0.4]])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    seq = Sequence("s", [0], params, max_tokens=8)
    ops = TorchOps(torch.device("cpu"))
    vocab = logits.shape[1]
    counts = torch.zeros(2 * vocab, dtype=torch.float64)
    trials = 4000
    for _ in range(trials):
        tokens, _ = verify_drafts(logits, [draft], seq, ops)
        if tokens[0] == draft:
            assert len(tokens) == 2
            counts[vocab + tokens[1]] += 1
        else:
            assert len(tokens) == 1
            counts[tokens[0]] += 1
    p = warped_probs(logits, temperature, top_k, top_p, 0.0).double()
    want = torch.cat([p[0], p[0, draft] * p[1]])
    want[draft] = 0.0
    assert chi_square_p_value(counts, want) > P_VALUE_FLOOR


def test_sampled_engine_output_keeps_the_distribution(tiny_llm: LLM) -> None:
    """Through the engine: three tokens sampled after a looping context (top-k 3; the first from the prefill row,
    the next two with drafts checked) follow the model's exact joint probabilities (from `LLM.logits`)."""
    prompt = repeat_prompts(seed=0)[5]
    # the model's greedy continuation falls into a 3-token loop: sampled continuations find drafts in it
    prompt += run_requests(make_engine(tiny_llm), [prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                                           ignore_eos=True))[0].output_token_ids
    config = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    engine = make_engine(tiny_llm, speculative=config)
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(600)]
    seqs = run_requests(engine, [prompt] * len(params), params)
    assert engine.stats.accepted_tokens > 50 and engine.stats.draft_tokens > engine.stats.accepted_tokens
    # exact law of (t2, t3) given t1 for each t1: p(t1) p(t2 | t1) p(t3 | t1, t2), over the top-3 sets
    base = tiny_llm.logits(prompt)[-1:]
    p1 = warped_probs(base, 1.0, 3, 1.0, 0.0)[0].double()
    outcomes: dict[tuple[int, int, int], float] = {}
    for t1 in torch.nonzero(p1)[:, 0].tolist():
        p2 = warped_probs(tiny_llm.logits(prompt + [t1])[-1:], 1.0, 3, 1.0, 0.0)[0].double()
        for t2 in torch.nonzero(p2)[:, 0].tolist():
            p3 = warped_probs(tiny_llm.logits(prompt + [t1, t2])[-1:], 1.0, 3, 1.0, 0.0)[0].double()
            for t3 in torch.nonzero(p3)[:, 0].tolist():
                outcomes[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    keys = list(outcomes)
    counts = torch.zeros(len(keys) + 1, dtype=torch.float64)
    for seq in seqs:
        key = tuple(seq.output_token_ids)
        counts[keys.index(key) if key in outcomes else -1] += 1
    want = torch.tensor([outcomes[k] for k in keys] + [0.0], dtype=torch.float64)
    assert chi_square_p_value(counts, want / want.sum()) > P_VALUE_FLOOR
    assert_pool_idle(engine.block_manager)
