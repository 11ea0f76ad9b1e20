"""SwiGLU: ``silu(gate) * up`` over the concatenated ``[T, 2 * I]`` output of the fused gate|up matmul.

Grid ``(T, cdiv(I, BLOCK))``: each program reads BLOCK gate values and the BLOCK up values I columns
further on, and writes BLOCK float32 outputs of ``[T, I]``. Torch reference: `TorchOps.silu_mul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, stride_xt, BLOCK: tl.constexpr):
    """BLOCK outputs of one token."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * I + cols, gate / (1.0 + tl.exp(-gate)) * up, mask=mask)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``silu(gate) * up`` for ``[T, 2 * I]`` (gate first), float32 ``[T, I]``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: gate_up must be [T, 2 * I] with unit column stride, got {tuple(gate_up.shape)}")
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), device=gate_up.device, dtype=torch.float32)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), BLOCK=block, num_warps=4)
    return out
