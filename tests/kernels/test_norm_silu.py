"""RMSNorm (fused residual add, per-head) and SwiGLU kernels against TorchOps in float64."""

from __future__ import annotations

import pytest
import torch

from gpullama.kernels.rms_norm import head_rms_norm, rms_norm
from gpullama.kernels.silu_mul import silu_mul
from gpullama.ops import TorchOps

REF = TorchOps(torch.device("cpu"), torch.float64)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return float((got.cpu().double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("hidden", [64, 100, 576])  # 100 and 576: not powers of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(hidden, with_residual, device):
    """Normalized output and the residual sum within 1e-5 of float64."""
    g = torch.Generator().manual_seed(hidden)
    x, w = torch.randn(5, hidden, generator=g), torch.randn(hidden, generator=g)
    residual = torch.randn(5, hidden, generator=g) if with_residual else None
    out, summed = rms_norm(x.to(device), w.to(device), 1e-6, residual.to(device) if with_residual else None)
    want, want_sum = REF.rms_norm(x.double(), w.double(), 1e-6, residual.double() if with_residual else None)
    assert out.dtype == torch.float32 and rel_err(out, want) < 1e-5
    assert rel_err(summed, want_sum) < 1e-6


def test_head_rms_norm_on_a_strided_view(device):
    """q heads viewed inside a fused qkv row (token stride > heads * D) are normalized without a copy."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 5 * 48, generator=g)
    q = qkv[:, : 3 * 48].view(3, 3, 48)
    w = torch.randn(48, generator=g)
    out = head_rms_norm(q.to(device), w.to(device), 1e-6)
    assert rel_err(out, REF.head_rms_norm(q.double(), w.double(), 1e-6)) < 1e-5


def test_rms_norm_rejects_wrong_weight(device):
    """A weight of the wrong size is a ValueError naming both sizes."""
    with pytest.raises(ValueError, match=r"\[8\].*\(7,\)"):
        rms_norm(torch.zeros(2, 8, device=device), torch.zeros(7, device=device), 1e-6)


@pytest.mark.parametrize("inter", [32, 1000])
def test_silu_mul_matches_torch(inter, device):
    """SwiGLU within 1e-5 of float64, including a tile tail (1000 = 3 * 256 + 232)."""
    gate_up = torch.randn(4, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3
    out = silu_mul(gate_up.to(device), block=256)
    assert out.shape == (4, inter) and rel_err(out, REF.silu_mul(gate_up.double())) < 1e-5


def test_silu_mul_rejects_odd_width(device):
    """An odd gate|up width is a ValueError with the shape."""
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        silu_mul(torch.zeros(2, 7, device=device))
