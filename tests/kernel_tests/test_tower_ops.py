"""The vision towers' ops under TritonOps (LayerNorm, the three GELU forms, the 2D rotary with no pool write, the
image attention) against TorchOps in float64."""

from __future__ import annotations

import pytest
import torch

from gpullama.kernels.gelu import gelu
from gpullama.kernels.layer_norm import layer_norm
from gpullama.ops import TorchOps
from gpullama.ops.triton_ops import TritonOps

REF = TorchOps(torch.device("cpu"), torch.float64)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return float((got.cpu().double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("hidden", [32, 100, 1152])  # 100: not a power of two; 1152: SigLIP's and Qwen3-VL's width
def test_layer_norm_matches_torch(hidden, device):
    """Rows far from zero (the variance from the centred values, no cancellation) and a strided view of a wider
    row: within 1e-5 of float64."""
    g = torch.Generator().manual_seed(hidden)
    wide = torch.randn(5, hidden + 7, generator=g) * 3 + 40
    x = wide[:, :hidden]  # token stride hidden + 7
    w, b = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g)
    out = layer_norm(x.to(device), w.to(device), b.to(device), 1e-6)
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert rel_err(out, REF.layer_norm(x.double(), w.double(), b.double(), 1e-6)) < 1e-5


def test_layer_norm_rejects_wrong_bias(device):
    """A bias of the wrong size is a ValueError naming both sizes."""
    with pytest.raises(ValueError, match=r"\[8\].*\(7,\)"):
        layer_norm(torch.zeros(2, 8, device=device), torch.zeros(8, device=device), torch.zeros(7, device=device), 1e-6)


@pytest.mark.parametrize("form", ["none", "tanh", "quick"])
def test_gelu_matches_torch(form, device):
    """Each form within 1e-6 of float64 over a row with a tile tail, large values of both signs included."""
    x = torch.randn(3, 1500, generator=torch.Generator().manual_seed(2)) * 4
    x[0, :4] = torch.tensor([-120.0, -30.0, 30.0, 120.0])
    out = gelu(x.to(device), form, block=512)
    assert out.dtype == torch.float32 and rel_err(out, REF.gelu(x.double(), form)) < 1e-6


def test_gelu_rejects_an_unknown_form(device):
    """An unknown form is a ValueError naming the forms."""
    with pytest.raises(ValueError, match="none, tanh, quick"):
        gelu(torch.zeros(2, 8, device=device), "sigmoid")


@pytest.mark.parametrize("head_dim", [72, 80])  # Gemma 3's / Qwen3-VL's and Qwen2-VL's head dims
def test_rotate_matches_torch(head_dim, device):
    """Qwen-VL's 2D rotary on q, k views of a fused qkv output: each row turned by its own table row, in place."""
    g = torch.Generator().manual_seed(head_dim)
    n, heads = 6, 3
    qkv = torch.randn(n, 3 * heads * head_dim, generator=g)
    angles = torch.rand(n, head_dim // 2, generator=g) * 6
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    want_q, want_k = REF.rotate(*qkv.double().view(n, 3, heads, head_dim).unbind(1)[:2], table.double())
    on_device = qkv.to(device)
    q, k, _ = on_device.view(n, 3, heads, head_dim).unbind(1)
    got_q, got_k = TritonOps(device).rotate(q, k, table.to(device))
    assert rel_err(got_q, want_q) < 1e-6 and rel_err(got_k, want_k) < 1e-6
    assert got_q.data_ptr() == q.data_ptr()  # rotated where the matmul wrote them


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("windows", [False, True], ids=["full", "windows"])
def test_image_attention_matches_torch(dtype, tolerance, windows, device):
    """Every patch attending to every other one (or within Qwen2.5-VL-like windows): the compute dtype's attention
    within `tolerance` of float64 (SDPA's FlashAttention, cuDNN or memory-efficient kernel on CUDA)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 40, 72, generator=g) for _ in range(3))
    mask = (torch.arange(40)[:, None] // 16 == torch.arange(40)[None, :] // 16) if windows else None
    got = TritonOps(device, dtype).image_attention(*(x.to(device) for x in (q, k, v)), 72 ** -0.5,
                                                   mask.to(device) if windows else None)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert rel_err(got, REF.image_attention(q.double(), k.double(), v.double(), 72 ** -0.5, mask)) < tolerance
