"""Device sampling kernel against its sorting torch reference."""

from __future__ import annotations

import pytest
import torch

from gpullama.kernels.sampling import sample
from tests.kernel_tests.sampling_reference import sample_reference


def _params(b: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-row parameters mixing greedy rows, each filter alone, and all filters together."""
    g = torch.Generator().manual_seed(seed)
    return {
        "temperature": torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 1.0][:b]),
        "top_k": torch.tensor([0, 0, 5, 0, 20, 1][:b], dtype=torch.int32),
        "top_p": torch.tensor([1.0, 1.0, 1.0, 0.8, 0.9, 1.0][:b]),
        "min_p": torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0][:b]),
        "uniform": torch.rand(b, generator=g),
    }


# Chunk tails: 300 = 256 + 44 and 1100 = 2 * 512 + 76 (small stand-ins for 49152 / 151936-token vocabs).
@pytest.mark.parametrize("vocab,block_v,seed", [(300, 256, 0), (1100, 512, 1)])
def test_sample_matches_reference(vocab, block_v, seed, device):
    """Greedy, temperature, top-k, top-p and min-p rows draw the reference's token for the same uniforms."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = _params(6, seed)
    want = sample_reference(logits, **params)
    got = sample(logits.to(device), **{k: v.to(device) for k, v in params.items()}, block_v=block_v)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == want.tolist()


def test_greedy_takes_first_of_tied_maxima_across_chunks(device):
    """argmax ties resolve to the lowest index, also when the tie spans two chunks."""
    logits = torch.zeros(1, 600)
    logits[0, [310, 590, 20]] = torch.tensor([5.0, 5.0, 4.0])
    zero = torch.zeros(1)
    got = sample(logits.to(device), zero.to(device), torch.zeros(1, dtype=torch.int32, device=device),
                 torch.ones(1, device=device), zero.to(device), zero.to(device), block_v=256)
    assert got.item() == 310 == int(torch.argmax(logits))


def test_top_k_one_is_greedy_for_any_uniform(device):
    """top_k = 1 keeps only the best token, whatever the uniform draw."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(9))
    ones = torch.ones(4, device=device)
    got = sample(logits.to(device), ones, torch.ones(4, dtype=torch.int32, device=device), ones,
                 torch.zeros(4, device=device), torch.tensor([0.0, 0.3, 0.7, 0.999], device=device), block_v=256)
    assert got.cpu().tolist() == torch.argmax(logits, dim=1).tolist()


def test_sampled_frequencies_follow_the_filtered_softmax(device):
    """Over a grid of uniforms, each kept token is drawn in proportion to its renormalized probability."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(16, 1)
    u = (torch.arange(16) + 0.5) / 16
    b = logits.shape[0]
    # min_p = 0.2 keeps the tokens with exp(logit - 2) >= 0.2: the first three
    got = sample(logits.to(device), torch.ones(b, device=device), torch.zeros(b, dtype=torch.int32, device=device),
                 torch.ones(b, device=device), torch.full((b,), 0.2, device=device), u.to(device), block_v=16)
    probs = torch.softmax(logits[0, :3].double(), 0)
    counts = torch.bincount(got.cpu(), minlength=6)
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3].double() / 16, probs, atol=1 / 16)


def test_sample_rejects_mismatched_parameters():
    """A parameter vector of the wrong length is a ValueError naming it."""
    logits = torch.zeros(2, 10)
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, z, torch.zeros(3, dtype=torch.int32), z, z, z)
