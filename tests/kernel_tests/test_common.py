"""The shared kernel helpers: bf16 rounding under the interpreter, exact float32 `tl.dot`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import dot, interpreting, round_to


@triton.jit
def _round_and_dot_kernel(x_ptr, rounded_ptr, a_ptr, b_ptr, c_ptr, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Round 16 x 16 values to DTYPE; multiply two 16 x 16 tiles with `dot`."""
    i = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(rounded_ptr + i, round_to(tl.load(x_ptr + i), DTYPE, EMULATE))
    acc = dot(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.zeros([16, 16], tl.float32), DTYPE, EMULATE)
    tl.store(c_ptr + i, acc)


def test_round_to_and_dot_match_torch(device):
    """round_to rounds to nearest like torch (the interpreter's own cast truncates); dot uses the rounded inputs."""
    g = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(16, 16, generator=g) for _ in range(3))
    for torch_dtype, tl_type in ((torch.bfloat16, tl.bfloat16), (torch.float16, tl.float16), (torch.float32, tl.float32)):
        rounded, c = torch.empty(16, 16, device=device), torch.empty(16, 16, device=device)
        _round_and_dot_kernel[(1,)](x.to(device), rounded, a.to(device), b.to(device), c, DTYPE=tl_type,
                                    EMULATE=interpreting())
        assert torch.equal(rounded.cpu(), x.to(torch_dtype).float())
        want = a.to(torch_dtype).double() @ b.to(torch_dtype).double()
        assert float((c.cpu().double() - want).abs().max() / want.abs().max()) < 1e-6
