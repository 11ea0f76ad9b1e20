"""GELU of a matmul's output, in the three forms the vision towers use: ``none`` (erf, ``x / 2 (1 + erf(x /
sqrt 2))``: the Qwen-VL mergers), ``tanh`` (SigLIP's and Qwen3-VL's blocks: ``x / (1 + exp(-2z))``,
``z = sqrt(2/pi) (x + 0.044715 x^3)``, the arithmetic of `silu_mul`'s GeGLU) and ``quick`` (Qwen2-VL's blocks:
``x / (1 + exp(-1.702 x))``).

Grid ``(T, cdiv(N, BLOCK))``: each program reads BLOCK values of one row (any row stride, unit column stride) and
writes them float32 into a new ``[T, N]`` tensor. erf is ``tl.math.erf`` (a core op since Triton 3.0, not a
libdevice call). Torch reference: `TorchOps.gelu` (``torch.nn.functional.gelu``, QuickGELU as transformers has it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FORMS = {"none": 0, "tanh": 1, "quick": 2}
"""GELU forms (torch's `approximate` names, plus QuickGELU) -> the kernel's FORM."""


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, N, stride_xt, FORM: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK outputs of one row."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    if FORM == 0:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif FORM == 1:
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi) (x + 0.044715 x^3)
        y = x / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))  # (capped: exp overflows past 88; x * 1e-35 is 0)
    else:
        y = x / (1.0 + tl.exp(tl.minimum(-1.702 * x, 80.0)))
    tl.store(out_ptr + t * N + cols, y, mask=mask)


def gelu(x: torch.Tensor, approximate: str = "none", block: int = 1024) -> torch.Tensor:
    """GELU of ``[T, N]`` (unit column stride) in the form `approximate` (``none``, ``tanh`` or ``quick``): float32
    ``[T, N]``."""
    if approximate not in FORMS:
        raise ValueError(f"gelu: approximate must be one of {', '.join(FORMS)}, got {approximate!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"gelu: x must be [T, N] with unit column stride, got {tuple(x.shape)}")
    t, n = x.shape
    out = torch.empty((t, n), device=x.device, dtype=torch.float32)
    if t and n:
        _gelu_kernel[(t, triton.cdiv(n, block))](x, out, n, x.stride(0), FORM=FORMS[approximate], BLOCK=block,
                                                  num_warps=4)
    return out
