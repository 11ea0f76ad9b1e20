"""RMSNorm (fused residual add, per-head), SwiGLU / GeGLU, the final-logit soft-cap and the tanh helper against
TorchOps (or torch) in float64."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from gpullama.kernels.common import tanh
from gpullama.kernels.rms_norm import head_rms_norm, rms_norm
from gpullama.kernels.silu_mul import gelu_tanh_mul, silu_mul
from gpullama.kernels.soft_cap import soft_cap
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


def test_rms_norm_scales_x_before_the_residual_add(device):
    """Granite's residual multiplier: ``x * x_scale + residual`` is normalized and returned."""
    g = torch.Generator().manual_seed(1)
    x, w, residual = torch.randn(3, 96, generator=g), torch.randn(96, generator=g), torch.randn(3, 96, generator=g)
    out, summed = rms_norm(x.to(device), w.to(device), 1e-5, residual.to(device), x_scale=0.22)
    want, want_sum = REF.rms_norm(x.double(), w.double(), 1e-5, residual.double(), x_scale=0.22)
    assert rel_err(out, want) < 1e-5 and rel_err(summed, want_sum) < 1e-6


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


@pytest.mark.parametrize("inter", [32, 1000])
def test_gelu_tanh_mul_matches_torch(inter, device):
    """GeGLU (Gemma's gelu with the tanh approximation) within 1e-5 of float64, large negative gates included."""
    gate_up = torch.randn(4, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    out = gelu_tanh_mul(gate_up.to(device), block=256)
    assert out.shape == (4, inter) and rel_err(out, REF.gelu_tanh_mul(gate_up.double())) < 1e-5


@pytest.mark.parametrize(("cap", "scale"), [(30.0, 1.0), (0.0, 0.125), (15.0, 0.5)])
def test_soft_cap_matches_torch(cap, scale, device):
    """Final logits times a scale (Granite), soft-capped (Gemma 2), over a row with a tile tail."""
    x = torch.randn(3, 1500, generator=torch.Generator().manual_seed(3)) * 40
    out = soft_cap(x.to(device), cap, scale, block=512)
    assert out.dtype == torch.float32 and rel_err(out, REF.soft_cap(x.double(), cap, scale)) < 1e-6


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tanh(tl.load(x_ptr + i, mask=i < N)), mask=i < N)


def test_tanh_helper_is_float32_accurate(device):
    """`common.tanh` (built from exp) within 4e-7 relative of torch's float64 tanh, tiny to saturating inputs."""
    x = torch.cat([torch.linspace(-30, 30, 2001), torch.logspace(-8, 0, 200), -torch.logspace(-8, 0, 200)])
    out = torch.empty_like(x, device=device)
    _tanh_kernel[(1,)](x.to(device), out, x.numel(), BLOCK=4096)
    want = torch.tanh(x.double())
    assert float(((out.cpu().double() - want).abs() / want.abs().clamp_min(1e-30)).max()) < 4e-7


def test_silu_mul_rejects_odd_width(device):
    """An odd gate|up width is a ValueError with the shape."""
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        silu_mul(torch.zeros(2, 7, device=device))
