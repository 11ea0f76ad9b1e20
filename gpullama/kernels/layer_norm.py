"""LayerNorm with weight and bias, the vision towers' norm (SigLIP, Qwen2-VL, Qwen3-VL and its deepstack mergers).

Grid ``(rows,)``, one program per ``[H]`` row; BLOCK is H rounded up to a power of two, so the row sits in registers:
one read of x, one write of ``(x - mean) / sqrt(var + eps) * weight + bias`` in float32. The variance is the mean
of the squared deviations (two passes over the registers, not ``E[x^2] - mean^2``, which cancels on rows far from
zero). Rows may be strided (a token stride passed in); the output is a new contiguous float32 ``[T, H]``. Torch
reference: `TorchOps.layer_norm` (`torch.nn.functional.layer_norm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import pow2


@triton.jit
def _layer_norm_kernel(x_ptr, weight_ptr, bias_ptr, out_ptr, H, stride_xt, eps, BLOCK: tl.constexpr):
    """``out = (x - mean) / sqrt(var + eps) * weight + bias`` for one row."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / H
    centred = tl.where(mask, x - mean, 0.0)
    variance = tl.sum(centred * centred, axis=0) / H
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, centred / tl.sqrt(variance + eps) * w + b, mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of ``[T, H]`` (any token stride, unit column stride; else copied) with `weight`
    and `bias` ``[H]``: float32 ``[T, H]``."""
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    t, h = x.shape
    if weight.shape != (h,) or bias.shape != (h,):
        raise ValueError(f"layer_norm: weight and bias must be [{h}] for rows of {h}, got {tuple(weight.shape)} and "
                         f"{tuple(bias.shape)}")
    out = torch.empty((t, h), device=x.device, dtype=torch.float32)
    if t:
        _layer_norm_kernel[(t,)](x, weight, bias, out, h, x.stride(0), eps, BLOCK=pow2(h),
                                 num_warps=4 if h <= 4096 else 8)
    return out
