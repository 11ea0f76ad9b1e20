"""Quantized matmul and embedding kernels against gguf's dequantizer and a float64 matmul."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpullama.kernels import quant_matmul
from gpullama.kernels.embedding import embedding
from gpullama.kernels.quant_matmul import GEMV_MAX_ROWS, quant_linear
from gpullama.quants import QTensor
from tests.fixtures.quant_blocks import random_blocks, random_float_tensor

Q = gguf.GGMLQuantizationType
QUANT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]
DENSE_TYPES = [Q.F16, Q.BF16, Q.F32]


def make_weight(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> tuple[QTensor, torch.Tensor]:
    """A random valid GGUF weight and its float64 reference values from gguf's own dequantizer."""
    if qtype in DENSE_TYPES:
        raw = random_float_tensor(qtype, rows, cols, seed)
    else:
        raw = random_blocks(qtype, rows, cols, seed)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64)).reshape(rows, cols)
    return QTensor(torch.from_numpy(raw), qtype, (rows, cols)), reference


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def cols_for(qtype: gguf.GGMLQuantizationType) -> int:
    """Columns that make 2+ blocks per row and a partial last BLOCK_K tile."""
    return 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 96


@pytest.mark.parametrize("qtype", QUANT_TYPES + DENSE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 21])
def test_linear_float32_matches_gguf_dequantize(qtype, m, device):
    """float32 compute: both kernels (GEMV for m <= 4, tl.dot above) within 1e-5 of the float64 reference."""
    n, k = 37, cols_for(qtype)  # 37 rows: not a multiple of any BLOCK_N
    weight, w_ref = make_weight(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(99))
    out = quant_linear(x.to(device), weight.to(device), bias.to(device), torch.float32, block_k=64)
    want = x.double() @ w_ref.T + bias.double()
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert rel_err(out.cpu(), want) < 1e-5


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("m", [2, 17])
def test_linear_half_compute_within_1e2(qtype, compute, m, device):
    """16-bit compute dtypes (x and weights rounded as TorchOps does) stay within 1e-2 of float64."""
    n, k = 24, cols_for(qtype)
    weight, w_ref = make_weight(qtype, n, k, seed=7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    out = quant_linear(x.to(device), weight.to(device), None, compute)
    assert rel_err(out.cpu(), x.double() @ w_ref.T) < 1e-2


def test_gemv_tail_of_vocab_sized_rows(device):
    """The vocab head: rows beyond the last full BLOCK_N tile (a stand-in for 49152 / 151936 rows)."""
    # 151936 = 1187 * 128 and 49152 = 3 * 16384 are multiples of the tiles; the kernels must also cover any
    # remainder, so use row counts that leave 1 and BLOCK_N - 1 rows in the last tile.
    for n in (16 * 3 + 1, 16 * 4 - 1):
        weight, w_ref = make_weight(Q.Q8_0, n, 64, seed=n)
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(n))
        out = quant_linear(x.to(device), weight.to(device), None, torch.float32, block_n=16)
        assert rel_err(out.cpu(), x.double() @ w_ref.T) < 1e-5


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.BF16], ids=lambda q: q.name)
def test_gpu_tile_shapes(qtype, device):
    """The tiles the GPU heuristics pick (GEMV 4 x 1024, tl.dot 16 x 128 x 128) on ragged rows."""
    weight, w_ref = make_weight(qtype, 37, 1024, seed=11)
    for m, block_n, block_k in ((2, 4, 1024), (5, 128, 128)):
        x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m))
        out = quant_linear(x.to(device), weight.to(device), None, torch.float32, block_n=block_n, block_k=block_k)
        assert rel_err(out.cpu(), x.double() @ w_ref.T) < 1e-5


def test_tile_heuristics_fill_a_hopper(monkeypatch):
    """On a 132-SM device: narrow GEMV tiles for 2048-row projections, wide ones for the vocab head."""
    monkeypatch.setattr(quant_matmul, "interpreting", lambda: False)
    monkeypatch.setattr(quant_matmul, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert quant_matmul.gemv_blocks(1, 2048, cuda) == (4, 1024)
    assert quant_matmul.gemv_blocks(1, 128256, cuda) == (16, 256)
    assert quant_matmul.matmul_blocks(8, 2048, cuda) == (16, 16, 128)
    assert quant_matmul.matmul_blocks(64, 128256, cuda) == (64, 128, 64)


def test_gemv_and_tiled_paths_agree_at_the_switch(device):
    """GEMV_MAX_ROWS and one more row take different kernels and give the same numbers."""
    weight, w_ref = make_weight(Q.Q4_0, 40, 64, seed=3)
    for m in (GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        assert rel_err(quant_linear(x.to(device), weight.to(device)).cpu(), x.double() @ w_ref.T) < 1e-5


def test_linear_rejects_mismatched_input(device):
    """A wrong inner dimension is a ValueError naming both shapes."""
    weight, _ = make_weight(Q.Q8_0, 8, 64, seed=0)
    with pytest.raises(ValueError, match=r"\[M, 64\].*\(2, 32\)"):
        quant_linear(torch.zeros(2, 32, device=device), weight.to(device))
    with pytest.raises(ValueError, match="block_k must be a power of two >= 32, got 48"):
        quant_linear(torch.zeros(2, 64, device=device), weight.to(device), block_k=48)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q6_K, Q.F16], ids=lambda q: q.name)
def test_embedding_matches_gguf_dequantize(qtype, device):
    """Gathered rows dequantized in the kernel equal gguf's dequantized rows."""
    vocab, hidden = 11, cols_for(qtype)
    table, ref = make_weight(qtype, vocab, hidden, seed=1)
    ids = torch.tensor([3, 0, 10, 3, 7])
    out = embedding(ids.to(device), table.to(device), block=128)
    assert out.dtype == torch.float32
    assert rel_err(out.cpu(), ref[ids]) < 1e-6


def test_embedding_rejects_out_of_range_ids():
    """A token id past the vocab is a ValueError naming the range."""
    table, _ = make_weight(Q.Q8_0, 4, 32, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        embedding(torch.tensor([1, 4]), table)
