"""Final-logit transform: ``x * scale`` (Granite's 1 / logit_scale), then soft-capping ``cap * tanh(. / cap)``
(Gemma 2's final-logit soft-capping) when HAS_CAP.

Grid ``(T, cdiv(V, BLOCK))``: each program reads BLOCK logits of one row and writes them float32 into a new
``[T, V]`` tensor; tanh is `common.tanh` (built from `tl.exp`). Torch reference: `TorchOps.soft_cap`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import tanh


@triton.jit
def _soft_cap_kernel(x_ptr, out_ptr, V, stride_xt, scale, cap, HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK logits of one row."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32) * scale
    if HAS_CAP:
        x = cap * tanh(x / cap)
    tl.store(out_ptr + t * V + cols, x, mask=mask)


def soft_cap(x: torch.Tensor, cap: float, scale: float = 1.0, block: int = 1024) -> torch.Tensor:
    """``x * scale``, soft-capped at ``cap * tanh(. / cap)`` when `cap` > 0, for ``[T, V]``: float32 ``[T, V]``."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"soft_cap: x must be [T, V] with unit column stride, got {tuple(x.shape)}")
    if cap < 0:
        raise ValueError(f"soft_cap: cap must be >= 0 (0: off), got {cap}")
    t, v = x.shape
    out = torch.empty((t, v), device=x.device, dtype=torch.float32)
    if t and v:
        _soft_cap_kernel[(t, triton.cdiv(v, block))](x, out, v, x.stride(0), float(scale), float(cap or 1.0),
                                                     HAS_CAP=cap > 0, BLOCK=block, num_warps=4)
    return out
