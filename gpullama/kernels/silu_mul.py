"""Gated MLP activations over the concatenated ``[T, 2 * I]`` output of the fused gate|up matmul: SwiGLU
``silu(gate) * up`` and GeGLU ``gelu_tanh(gate) * up`` (Gemma).

Grid ``(T, cdiv(I, BLOCK))``: each program reads BLOCK gate values and the BLOCK up values I columns
further on, and writes BLOCK float32 outputs of ``[T, I]``. GeGLU uses ``0.5 (1 + tanh z) = sigmoid(2z)``:
``gelu_tanh(g) = g / (1 + exp(-2z))`` with ``z = sqrt(2/pi) (g + 0.044715 g^3)``, which needs no tanh and loses
nothing near 0. Torch reference: `TorchOps.silu_mul` / `TorchOps.gelu_tanh_mul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, stride_xt, BLOCK: tl.constexpr, GELU: tl.constexpr):
    """BLOCK outputs of one token (GELU: GeGLU instead of SwiGLU)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + I + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (g + 0.044715 g^3)
        act = gate / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))  # (capped: exp overflows past 88; g * 1e-35 is 0)
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + t * I + cols, act * up, mask=mask)


def silu_mul(gate_up: torch.Tensor, block: int = 1024, gelu: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (or with `gelu`, ``gelu_tanh(gate) * up``) for ``[T, 2 * I]`` (gate first), float32
    ``[T, I]``."""
    name = "gelu_tanh_mul" if gelu else "silu_mul"
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"{name}: gate_up must be [T, 2 * I] with unit column stride, got {tuple(gate_up.shape)}")
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), device=gate_up.device, dtype=torch.float32)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), BLOCK=block, GELU=gelu,
                                                       num_warps=4)
    return out


def gelu_tanh_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """GeGLU: ``gelu_tanh(gate) * up`` for ``[T, 2 * I]`` (gate first), float32 ``[T, I]``."""
    return silu_mul(gate_up, block, gelu=True)
