"""The sampler's filters and penalties against independent numpy references (vLLM / OpenAI definitions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpullama.engine.sampler import apply_penalties, sample_batch
from gpullama.engine.sequence import Sequence
from gpullama.ops import TorchOps, keep_mask
from gpullama.sampling_params import SamplingParams

VOCAB = 50
OPS = TorchOps(torch.device("cpu"))


def random_logits(seed: int, scale: float = 3.0) -> np.ndarray:
    """Distinct random float64 logits (ties would make the kept sets ambiguous)."""
    return np.random.default_rng(seed).normal(0.0, scale, VOCAB)


def np_softmax(x: np.ndarray) -> np.ndarray:
    """Softmax that treats -inf as probability 0."""
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def reference_keep(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Kept-token mask in vLLM's order: min-p on the full distribution, then top-k, then top-p on what is left
    (a token is kept while the probability mass strictly before it, in descending order, is below top_p)."""
    probs = np_softmax(logits)
    keep = probs >= min_p * probs.max()
    if 0 < top_k < len(logits):
        keep &= logits >= np.sort(logits)[-top_k]
    if top_p < 1.0:
        renorm = np.where(keep, probs, 0.0)
        renorm = renorm / renorm.sum()
        order = np.argsort(-renorm)
        before = np.cumsum(renorm[order]) - renorm[order]
        nucleus = np.zeros(len(logits), dtype=bool)
        nucleus[order[before < top_p]] = True
        keep &= nucleus
    return keep


def check_filter(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> None:
    """keep_mask (the torch path's filter, and the Triton kernel's reference) keeps exactly the reference set."""
    x = torch.tensor(logits, dtype=torch.float32)[None]
    e = torch.exp(x - x.max())
    got = keep_mask(e, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0].numpy()
    keep = reference_keep(logits, top_k, top_p, min_p)
    assert np.array_equal(got, keep), f"kept {np.flatnonzero(got)} want {np.flatnonzero(keep)}"


@pytest.mark.parametrize("top_k", [1, 3, 10, 49])
def test_top_k_keeps_the_k_largest(top_k: int) -> None:
    """top-k keeps exactly the k largest logits."""
    for seed in range(3):
        check_filter(random_logits(seed), top_k, 1.0, 0.0)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_nucleus(top_p: float) -> None:
    """top-p keeps the smallest most-likely set whose mass reaches top_p."""
    for seed in range(3):
        check_filter(random_logits(seed + 10), 0, top_p, 0.0)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_keeps_tokens_near_the_top(min_p: float) -> None:
    """min-p keeps tokens whose probability is at least min_p times the largest."""
    for seed in range(3):
        check_filter(random_logits(seed + 20), 0, 1.0, min_p)


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(10, 0.7, 0.0), (5, 0.5, 0.05), (20, 0.9, 0.02), (3, 0.2, 0.3)])
def test_combined_filters_follow_vllm_order(top_k: int, top_p: float, min_p: float) -> None:
    """top-k, top-p and min-p together keep the set vLLM's order gives (min-p, top-k, then top-p renormalised)."""
    for seed in range(3):
        check_filter(random_logits(seed + 30, scale=1.5), top_k, top_p, min_p)


@pytest.mark.parametrize("with_nucleus_row", [False, True])
def test_rows_of_one_batch_keep_their_own_sets(with_nucleus_row: bool) -> None:
    """A batch whose rows mix top-k sizes, min-p and filters off keeps per row what that row alone keeps (without
    a top-p row the filter takes the k-th largest value instead of sorting; with one, every row is sorted)."""
    settings = [(0, 1.0, 0.0), (1, 1.0, 0.0), (7, 1.0, 0.0), (49, 1.0, 0.1), (VOCAB, 1.0, 0.05), (-1, 1.0, 0.3),
                (12, 1.0, 0.0)]
    if with_nucleus_row:
        settings.append((5, 0.6, 0.0))
    logits = np.stack([random_logits(seed + 40) for seed in range(len(settings))])
    x = torch.tensor(logits, dtype=torch.float32)
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    k, p, m = (torch.tensor(column) for column in zip(*settings, strict=True))
    got = keep_mask(e, k, p, m).numpy()
    for row, (top_k, top_p, min_p) in enumerate(settings):
        keep = reference_keep(logits[row], top_k, top_p, min_p)
        assert np.array_equal(got[row], keep), f"row {row} {settings[row]}: kept {np.flatnonzero(got[row])}"


@pytest.mark.parametrize("scale", [4.0, 0.3])
def test_nucleus_beyond_the_first_candidates(scale: float) -> None:
    """With a vocabulary wider than the candidates taken for top-p, rows whose nucleus lies among them (peaked
    logits) and rows whose nucleus does not (flat logits: the full sort) keep the reference sets, also next to
    top-k, min-p and rows without top-p."""
    from gpullama.ops.sampling import NUCLEUS_CANDIDATES

    vocab = 4 * NUCLEUS_CANDIDATES + 13
    settings = [(0, 0.9, 0.0), (0, 0.5, 0.0), (600, 0.95, 0.0), (40, 0.8, 0.0), (0, 0.99, 0.001), (0, 1.0, 0.0),
                (7, 1.0, 0.2)]
    logits = np.stack([np.random.default_rng(50 + i).normal(0.0, scale, vocab) for i in range(len(settings))])
    x = torch.tensor(logits, dtype=torch.float32)
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    k, p, m = (torch.tensor(column) for column in zip(*settings, strict=True))
    got = keep_mask(e, k, p, m).numpy()
    sizes = []
    for row, (top_k, top_p, min_p) in enumerate(settings):
        keep = reference_keep(logits[row], top_k, top_p, min_p)
        sizes.append(int(keep.sum()))
        assert np.array_equal(got[row], keep), f"row {row} {settings[row]}: {got[row].sum()} kept, want {keep.sum()}"
    nucleus_sizes = [size for size, (_, top_p, _) in zip(sizes, settings, strict=True) if top_p < 1]
    if scale > 1:  # the case the candidates hold
        assert max(nucleus_sizes) < NUCLEUS_CANDIDATES
    else:  # the case that needs the full sort
        assert max(nucleus_sizes) > NUCLEUS_CANDIDATES


def sequence(prompt: list[int], output: list[int], **params) -> Sequence:
    """A sequence with the given prompt, already-generated tokens and sampling params."""
    seq = Sequence("s", prompt, SamplingParams(**params), max_tokens=100)
    for token in output:
        seq.append_token(token)
    return seq


def reference_penalties(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """Logit bias, then the repetition penalty on every prompt or output token (divide positive logits, multiply
    negative ones), then OpenAI's ``logit -= frequency * count + presence * (count > 0)`` over output tokens."""
    out = logits.copy()
    for token, bias in p.logit_bias.items():
        out[token] += bias
    for token in set(prompt) | set(output):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=VOCAB)
    out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.8),
        dict(presence_penalty=0.6),
        dict(frequency_penalty=-0.4),
        dict(presence_penalty=1.1, frequency_penalty=0.5, repetition_penalty=1.2),
        dict(logit_bias={2: 5.0, 7: -3.0, 40: 1.5}, repetition_penalty=1.5, frequency_penalty=0.3),
    ],
)
def test_penalties_change_the_right_logits(params: dict) -> None:
    """Penalties and bias move exactly the logits the vLLM/OpenAI definitions move, by the defined amounts."""
    prompt, output = [1, 2, 3, 3, 9, 40], [3, 5, 5, 5, 11, 2, 48]
    seq = sequence(prompt, output, **params)
    logits = random_logits(7)
    got = apply_penalties(torch.tensor(logits, dtype=torch.float32), seq).double().numpy()
    want = reference_penalties(logits, prompt, output, seq.params)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_penalties_without_output_leave_presence_and_frequency_alone() -> None:
    """Before any token is generated, presence/frequency penalties change nothing; prompt tokens never count."""
    seq = sequence([1, 2, 3], [], presence_penalty=2.0, frequency_penalty=2.0)
    logits = random_logits(8)
    got = apply_penalties(torch.tensor(logits, dtype=torch.float32), seq).double().numpy()
    np.testing.assert_allclose(got, logits, rtol=1e-6)


def test_greedy_with_penalties_is_the_argmax_of_the_penalised_logits() -> None:
    """A greedy row with penalties picks the reference argmax, next to a plain greedy row in the same batch."""
    logits = np.stack([random_logits(9), random_logits(10)])
    top = int(np.argmax(logits[0]))
    penalised = sequence([top], [top], temperature=0.0, repetition_penalty=3.0, presence_penalty=2.0)
    plain = sequence([top], [], temperature=0.0)
    tokens, _ = sample_batch(torch.tensor(logits, dtype=torch.float32), [penalised, plain], OPS)
    want = reference_penalties(logits[0], [top], [top], penalised.params)
    assert tokens == [int(np.argmax(want)), int(np.argmax(logits[1]))]


def test_sampling_frequencies_follow_the_filtered_distribution() -> None:
    """Seeded draws from a top-k row land only in the kept set, at the reference frequencies."""
    logits = random_logits(12, scale=1.0)
    seq = sequence([0], [], temperature=0.7, top_k=4, seed=2024)
    row = torch.tensor(logits, dtype=torch.float32)[None]
    draws = np.array([sample_batch(row, [seq], OPS)[0][0] for _ in range(3000)])
    keep = reference_keep(logits / 0.7, 4, 1.0, 0.0)
    assert set(np.unique(draws)) <= set(np.flatnonzero(keep))
    want = np.where(keep, np_softmax(logits / 0.7), 0.0)
    freq = np.bincount(draws, minlength=VOCAB) / len(draws)
    assert np.abs(freq - want / want.sum()).max() < 0.03


def test_each_sequence_draws_from_its_own_generator() -> None:
    """Two rows with the same seed draw the same tokens whatever else is in the batch; draws don't shift another
    sequence's generator."""
    logits = torch.tensor(np.stack([random_logits(13, 1.0)] * 3), dtype=torch.float32)
    a, b = sequence([0], [], temperature=1.0, seed=5), sequence([0], [], temperature=1.0, seed=5)
    c = sequence([0], [], temperature=1.0, seed=6)
    first = [sample_batch(logits, [a, c, b], OPS)[0] for _ in range(20)]
    assert all(row[0] == row[2] for row in first)
    alone = sequence([0], [], temperature=1.0, seed=5)
    assert [sample_batch(logits[:1], [alone], OPS)[0][0] for _ in range(20)] == [row[0] for row in first]


@pytest.mark.parametrize(("nucleus", "greedy_row"), [(True, True), (False, True), (False, False)])
def test_torch_sample_matches_the_float64_reference(nucleus: bool, greedy_row: bool) -> None:
    """TorchOps.sample (the CPU path) draws the same tokens as the Triton kernel's sorting float64 reference, for
    random mixes of greedy and filtered rows and the same uniforms; also for batches with no top-p row (no sort)
    and with no greedy row."""
    from tests.kernel_tests.sampling_reference import sample_reference

    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        b = 6
        logits = torch.randn(b, VOCAB, generator=gen) * 3
        temperature = torch.tensor([0.0 if greedy_row else 0.3, 0.5, 1.0, 1.5, 0.8, 1.0])
        temperature = temperature[torch.randperm(b, generator=gen)]
        top_k = torch.randint(0, VOCAB + 3, (b,), generator=gen)
        top_p = torch.where(torch.rand(b, generator=gen) < 0.5, torch.rand(b, generator=gen), torch.ones(b))
        if not nucleus:
            top_p = torch.ones(b)
        min_p = torch.where(torch.rand(b, generator=gen) < 0.5, torch.rand(b, generator=gen) * 0.3, torch.zeros(b))
        uniform = torch.rand(b, generator=gen)
        params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, uniform=uniform)
        assert OPS.sample(logits, **params).tolist() == sample_reference(logits, **params).tolist()
