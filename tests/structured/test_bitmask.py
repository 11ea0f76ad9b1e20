"""Bitmask helpers and every apply path against a numpy reference built from the bitmask's bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpullama.structured import allocate_bitmask, allow_only, apply_bitmask, bitmask_to_bool, bitmask_width, get_backend
from gpullama.structured.bitmask import apply_bitmask_cpu, apply_bitmask_torch
from tests.structured.helpers import allowed_ids, allowed_matrix


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (rows, bitmask_width(vocab)), dtype=torch.int32, generator=gen)


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> np.ndarray:
    out = logits.float().numpy().copy()
    allowed = allowed_matrix(bitmask, logits.shape[-1])
    for r in (range(logits.shape[0]) if rows is None else rows):
        out[r, ~allowed[r]] = -np.inf
    return out


def test_allocate_and_allow_only():
    assert bitmask_width(32) == 1 and bitmask_width(33) == 2 and bitmask_width(49152) == 1536
    bm = allocate_bitmask(3, 100)
    assert bm.shape == (3, 4) and bm.dtype == torch.int32
    assert allowed_ids(bm, 0, 100).tolist() == list(range(100))
    allow_only(bm, 1, [0, 31, 32, 63, 99])
    assert allowed_ids(bm, 1, 100).tolist() == [0, 31, 32, 63, 99]
    assert allowed_ids(bm, 2, 100).tolist() == list(range(100))


def test_bitmask_to_bool_matches_numpy():
    bm = _random_bitmask(4, 1000, 1)
    assert np.array_equal(bitmask_to_bool(bm, 1000).numpy(), allowed_matrix(bm, 1000))


@pytest.fixture(scope="module")
def grammar_backend(vocab_tokenizer):
    return get_backend(vocab_tokenizer("qwen2"))


def _apply(path: str, backend):
    if path == "backend":
        return backend.apply_bitmask
    return {"dispatch": apply_bitmask, "torch": apply_bitmask_torch, "cpu": apply_bitmask_cpu}[path]


_PATHS_DTYPES = [(p, d) for p in ("dispatch", "torch", "backend") for d in (torch.float32, torch.bfloat16)] + \
    [("cpu", torch.float32), ("cpu", torch.float16), ("cpu", torch.bfloat16)]


@pytest.mark.parametrize("path, dtype", _PATHS_DTYPES)
@pytest.mark.parametrize("vocab", [64, 707, 49152 + 17])
@pytest.mark.parametrize("rows", [None, [1], [0, 3]])
def test_apply_masks_exactly_the_disallowed_columns(grammar_backend, path, vocab, dtype, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(4, vocab, generator=gen) * 5).to(dtype)
    bitmask = _random_bitmask(4, vocab, vocab + 1)
    expected = _reference(logits, bitmask, rows)
    _apply(path, grammar_backend)(logits, bitmask, rows)
    assert np.array_equal(logits.float().numpy(), expected)


@pytest.mark.parametrize("path", ["dispatch", "torch", "cpu", "backend"])
def test_apply_refuses_a_bitmask_narrower_than_the_logits(grammar_backend, path):
    logits = torch.zeros(2, 100)
    narrow = allocate_bitmask(2, 64)  # covers 64 columns: a kernel that trusts it would leave 64..99 unmasked
    with pytest.raises(ValueError, match="allocate it for the logits width"):
        _apply(path, grammar_backend)(logits, narrow)


@pytest.mark.parametrize("path", ["dispatch", "torch", "cpu", "backend"])
def test_apply_masks_the_last_columns_of_a_width_not_a_multiple_of_32(grammar_backend, path):
    logits = torch.zeros(1, 70)
    bm = allocate_bitmask(1, 70)
    allow_only(bm, 0, [3])
    _apply(path, grammar_backend)(logits, bm)
    assert torch.isinf(logits[0, 64:]).all() and logits[0, 3] == 0 and torch.isinf(logits[0]).sum() == 69


@pytest.mark.parametrize("path", ["dispatch", "torch", "cpu"])
@pytest.mark.parametrize("rows", [None, [1]])
def test_apply_takes_inference_tensors(path, rows):
    """The engine's logits come out of inference mode."""
    with torch.inference_mode():
        logits = torch.zeros(2, 70)
    bm = allocate_bitmask(2, 70)
    allow_only(bm, 1, [5])
    expected = _reference(logits.clone(), bm, rows)
    _apply(path, None)(logits, bm, rows)
    assert np.array_equal(logits.numpy(), expected)
