"""RMSNorm fused with the residual add, and the per-head q/k RMSNorm of Qwen3 and Gemma 3.

Grid ``(rows,)``, one program per normalized vector of H values (a token, or one head of a token); BLOCK is
H rounded up to a power of two, so the whole vector sits in registers: one read of x (and residual), one write
of the sum and one of the normalized output. Row r of a ``[T, heads, H]`` view is token ``r // heads``, head
``r % heads`` (strides passed in, so q/k views of the fused qkv output need no copy). Sums are float32. With a
residual, x is first multiplied by `x_scale` (Granite's residual multiplier). Gemma's post-norms are the same
kernel without a residual. Torch reference: `TorchOps.rms_norm` / `post_norm` / `head_rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    H, HEADS, stride_xt, stride_xh, stride_rt, eps, x_scale,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """``out = (x * x_scale + residual) / rms * weight`` for one row; the sum goes to `sum_ptr` when there is a
    residual."""
    r = tl.program_id(0).to(tl.int64)
    t = r // HEADS
    h = r % HEADS
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x * x_scale + tl.load(residual_ptr + t * stride_rt + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(sum_ptr + r * H + cols, x, mask=mask)
    variance = tl.sum(x * x, axis=0) / H
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * H + cols, x / tl.sqrt(variance + eps) * w, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, x_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x * x_scale + residual) * weight, x * x_scale + residual)`` for ``[T, H]`` inputs (`x_scale` only
    with a residual), float32 outputs."""
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    t, h = x.shape
    if weight.shape != (h,):
        raise ValueError(f"rms_norm: weight must be [{h}] for hidden size {h}, got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual must be {tuple(x.shape)} with unit last stride, got {tuple(residual.shape)}")
    out = torch.empty((t, h), device=x.device, dtype=torch.float32)
    summed = torch.empty_like(out) if residual is not None else x
    if t:
        _rms_norm_kernel[(t,)](
            x, residual if residual is not None else x, weight, out, summed,
            h, 1, x.stride(0), 0, residual.stride(0) if residual is not None else 0, eps, float(x_scale),
            HAS_RESIDUAL=residual is not None, BLOCK=pow2(h), num_warps=4 if h <= 4096 else 8,
        )
    return out, summed


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``[T, heads, D]`` (any token/head strides), float32 ``[T, heads, D]``."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"head_rms_norm: x must be [T, heads, D] with unit last stride, got {tuple(x.shape)}")
    t, heads, d = x.shape
    if weight.shape != (d,):
        raise ValueError(f"head_rms_norm: weight must be [{d}] for head dim {d}, got {tuple(weight.shape)}")
    out = torch.empty((t, heads, d), device=x.device, dtype=torch.float32)
    if t * heads:
        _rms_norm_kernel[(t * heads,)](
            x, x, weight, out, out, d, heads, x.stride(0), x.stride(1), 0, eps, 1.0,
            HAS_RESIDUAL=False, BLOCK=pow2(d), num_warps=1,
        )
    return out
