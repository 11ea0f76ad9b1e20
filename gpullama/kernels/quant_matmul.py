"""``x @ W.T`` straight from GGUF blocks: weights stay in their file size and are dequantized in registers.

Two kernels share `gguf_blocks.dequantize_tile`:
- `_gemv_kernel` (decode, at most GEMV_MAX_ROWS rows of x): grid ``(M * cdiv(N, BLOCK_N),)``; each program owns
  BLOCK_N output features of one token and walks K in BLOCK_K steps, dequantizing a ``[BLOCK_N, BLOCK_K / SUB,
  SUB]`` weight tile (SUB values share a scale: the scales are decoded once per sub-block) and accumulating
  ``w * x`` in float32, reduced once at the end. At batch 1 the kernel streams each weight byte once.
- `_matmul_kernel` (prefill and wide decode): grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``; a ``[BLOCK_M,
  BLOCK_N]`` float32 accumulator fed by `tl.dot` of an x tile and the dequantized weight tile, reshaped to
  ``[BLOCK_N, BLOCK_K]`` and transposed.
Both round x and the weights to the compute dtype before multiplying, as `TorchOps.linear` does, and return
float32 ``[M, N]`` (+ bias). Torch reference: `TorchOps.linear` over `QTensor.dequantize` (tests use
`gguf.quants.dequantize` and a float64 matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import dot, interpreting, round_to, sm_count, tl_dtype
from gpullama.kernels.gguf_blocks import DENSE_FORMATS, dequantize_tile, sub_block_size, weight_pointers
from gpullama.quants import QTensor

GEMV_MAX_ROWS = 4
"""Up to this many tokens the GEMV kernel is used; above, the tiled `tl.dot` kernel."""


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, h_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, row_stride,
    FMT: tl.constexpr, SUB: tl.constexpr, HAS_BIAS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One token's BLOCK_N outputs: float32 sum over K of dequantized weight times x."""
    pid = tl.program_id(0)
    pid_n = pid // M
    m = (pid % M).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    subs = tl.arange(0, BLOCK_K // SUB)[None, :, None]
    lane = tl.arange(0, SUB)[None, None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // SUB, SUB], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        sub = k0 // SUB + subs
        cols = sub * SUB + lane
        x = tl.load(x_ptr + m * stride_xm + cols, mask=cols < K, other=0.0)
        x = round_to(x, COMPUTE_DTYPE, EMULATE)
        w = dequantize_tile(w_ptr, h_ptr, rows[:, None, None], sub, lane, row_stride, row_mask[:, None, None], K,
                            FMT, SUB)
        acc += round_to(w, COMPUTE_DTYPE, EMULATE) * x
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rows, out, mask=row_mask)


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, h_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, row_stride,
    FMT: tl.constexpr, SUB: tl.constexpr, HAS_BIAS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A ``[BLOCK_M, BLOCK_N]`` tile of ``x @ W.T`` by `tl.dot` over dequantized weight tiles."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows_m < M
    mask_n = rows_n < N
    subs = tl.arange(0, BLOCK_K // SUB)[None, :, None]
    lane = tl.arange(0, SUB)[None, None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + cols[None, :],
                    mask=mask_m[:, None] & (cols[None, :] < K), other=0.0)
        w = dequantize_tile(w_ptr, h_ptr, rows_n[:, None, None], k0 // SUB + subs, lane, row_stride,
                            mask_n[:, None, None], K, FMT, SUB)
        acc = dot(x, tl.trans(tl.reshape(w, [BLOCK_N, BLOCK_K])), acc, COMPUTE_DTYPE, EMULATE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows_m[:, None] * stride_om + rows_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


def _operands(weight: QTensor | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """(data, float16 view, row stride, FMT, N, K) of a prepared weight."""
    if isinstance(weight, QTensor):
        if weight.qtype.name in ("F32", "F16", "BF16"):
            weight = weight.data
        else:
            data, halves, row_stride = weight_pointers(weight.data, weight.qtype)
            return data, halves, row_stride, int(weight.qtype), weight.shape[0], weight.shape[1]
    if weight.dim() != 2 or weight.stride(1) != 1 or weight.dtype not in DENSE_FORMATS:
        raise ValueError(f"dense weight must be a float32/16 or bfloat16 matrix with unit column stride, got {weight.dtype} {tuple(weight.shape)}")
    return weight, weight, weight.stride(0), DENSE_FORMATS[weight.dtype], weight.shape[0], weight.shape[1]


def gemv_blocks(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the GEMV: the widest row tile that still gives every SM 4+ programs, 4096 values a tile."""
    if interpreting():
        return 64, 256  # the interpreter pays per program, not per byte
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) * m < 4 * sm_count(device):
        block_n //= 2
    return block_n, 4096 // block_n


def matmul_blocks(m: int, n: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the tiled kernel: the widest N tile that still gives every SM 2+ programs."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 128
    while block_n > 16 and triton.cdiv(n, block_n) * triton.cdiv(m, block_m) < 2 * sm_count(device):
        block_n //= 2
    return block_m, block_n, 128 if block_m <= 32 else 64


def quant_linear(
    x: torch.Tensor,
    weight: QTensor | torch.Tensor,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` as float32 ``[M, N]``; `weight` is a QTensor of raw GGUF blocks or a dense matrix.

    `block_n` / `block_k` override the tile heuristics (powers of two; block_k >= 32, block_n >= 16 for M > 4).
    """
    data, halves, row_stride, fmt, n, k = _operands(weight)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quant_linear: x must be [M, {k}] for a weight of shape [{n}, {k}], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"quant_linear: bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    m = x.shape[0]
    for name, value, least in (("block_k", block_k, 32), ("block_n", block_n, 16 if m > GEMV_MAX_ROWS else 1)):
        if value is not None and (value < least or value & (value - 1)):
            raise ValueError(f"quant_linear: {name} must be a power of two >= {least}, got {value}")
    out = torch.empty((m, n), device=x.device, dtype=torch.float32)
    if m == 0:
        return out
    compute = tl_dtype(compute_dtype, "quant_linear compute dtype")
    bias_arg = bias if bias is not None else out
    if m <= GEMV_MAX_ROWS:
        auto_n, auto_k = gemv_blocks(m, n, x.device)
        block_n, block_k = block_n or auto_n, block_k or auto_k
        # one program per (row tile, token), the tokens of a tile adjacent so its bytes are re-read from L2
        _gemv_kernel[(m * triton.cdiv(n, block_n),)](
            x, data, halves, bias_arg, out, m, n, k, x.stride(0), out.stride(0), row_stride,
            FMT=fmt, SUB=sub_block_size(fmt), HAS_BIAS=bias is not None, COMPUTE_DTYPE=compute,
            EMULATE=interpreting(), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
        return out
    block_m, auto_n, auto_k = matmul_blocks(m, n, x.device)
    block_n, block_k = block_n or auto_n, block_k or auto_k
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _matmul_kernel[grid](
        x, data, halves, bias_arg, out, m, n, k, x.stride(0), out.stride(0), row_stride,
        FMT=fmt, SUB=sub_block_size(fmt), HAS_BIAS=bias is not None, COMPUTE_DTYPE=compute, EMULATE=interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )
    return out
