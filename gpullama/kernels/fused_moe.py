"""Mixture-of-experts as two grouped GEMMs over token-expert pairs sorted by expert (vLLM's ``fused_moe`` scheme),
on the experts' GGUF blocks (dequantized in registers by `gguf_blocks.dequantize_tile`).

Shapes: x ``[T, H]``; each token's experts ``ids [T, k]`` and weights ``[T, k]``; P = T * k pairs, pair p = t * k
+ j. Experts are stacked ``[E, N, K]`` (gate|up: N = 2I gate rows then up rows, K = H; down: N = H, K = I), raw
blocks ``[E, N, bytes per row]`` or a dense float matrix.

1. `align_pairs` (torch, fixed shapes, no host sync: CUDA-graph safe) sorts the pairs by expert and pads each
   expert's run to a multiple of BLOCK_M: ``sorted_pairs [capacity]`` (P marks padding) and ``block_experts
   [capacity / BLOCK_M]`` (-1 past the last run), capacity = P + E * (BLOCK_M - 1) rounded up to BLOCK_M.
2. `_grouped_gemm_kernel`, grid ``(capacity / BLOCK_M, cdiv(N, BLOCK_N))``: a program takes BLOCK_M pairs of one
   expert, gathers their A rows (x of the pair's token for gate|up, the pair's own activation row for down),
   multiplies by the expert's dequantized ``[BLOCK_N, BLOCK_K]`` tiles with `tl.dot`, adds the expert's bias,
   optionally scales by the pair's routing weight, and writes row p of ``[P, N]``.
3. gate|up ``[P, 2I]`` -> activation (silu, gpt-oss's clamped SwiGLU, or GeGLU: Gemma 4) ``[P, I]`` -> down, weighted ``[P, H]``
   -> summed over each token's k pairs ``[T, H]``.
Inputs and weights are rounded to the compute dtype before multiplying, as `quant_linear` does; float32 out.
Torch reference: `gpullama.ops.torch_ops.TorchOps.moe` (each expert's rows, in expert order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import dot, interpreting, tl_dtype
from gpullama.kernels.gguf_blocks import DENSE_FORMATS, dequantize_tile, sub_block_size, weight_pointers
from gpullama.quants import QTensor


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs ``[capacity]`` int32, block_experts ``[capacity / block_m]`` int32): the pairs of each expert
    in pair order, each expert's run padded to a multiple of `block_m` with P (no pair)."""
    flat = ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    capacity = triton.cdiv(p + num_experts * (block_m - 1), block_m) * block_m
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # pairs by expert, in pair order within one
    expert_of = flat[order]
    slot = padded_start[expert_of] + torch.arange(p, device=device) - start[expert_of]
    sorted_pairs = torch.full((capacity,), p, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_pairs, block_experts


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, h_ptr, bias_ptr, scale_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr,
    P, N, K, TOP_K, stride_am, stride_om, row_stride, expert_stride, bias_stride,
    FMT: tl.constexpr, SUB: tl.constexpr, A_PER_PAIR: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_ROWS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``out[p, n0:n0 + BLOCK_N]`` for the BLOCK_M pairs of one padded block, all routed to the same expert."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < P
    a_rows = (pairs if A_PER_PAIR else pairs // TOP_K).to(tl.int64)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows_n < N
    w_expert = w_ptr + expert.to(tl.int64) * expert_stride
    h_expert = h_ptr + expert.to(tl.int64) * (expert_stride // 2)  # the float16 view (even strides: not MXFP4)
    subs = tl.arange(0, BLOCK_K // SUB)[None, :, None]
    lane = tl.arange(0, SUB)[None, None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + cols[None, :], mask=mask_m[:, None] & (cols[None, :] < K),
                    other=0.0)
        w = dequantize_tile(w_expert, h_expert, rows_n[:, None, None], k0 // SUB + subs, lane, row_stride,
                            mask_n[:, None, None], K, FMT, SUB)
        acc = dot(a, tl.trans(tl.reshape(w, [BLOCK_N, BLOCK_K])), acc, COMPUTE_DTYPE, EMULATE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * bias_stride + rows_n, mask=mask_n, other=0.0)[None, :]
    if SCALE_ROWS:
        acc *= tl.load(scale_ptr + pairs, mask=mask_m, other=0.0)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + rows_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


def _expert_operands(experts: QTensor | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, int, int]:
    """(data, float16 view, row stride, expert stride, FMT, E, N, K) of stacked experts ``[E, N, K]``."""
    if isinstance(experts, QTensor) and experts.qtype.name in ("F32", "F16", "BF16"):
        experts = experts.data
    if isinstance(experts, QTensor):
        e, n, k = experts.shape
        data, halves, row_stride = weight_pointers(experts.data.reshape(e * n, -1), experts.qtype)
        return data, halves, row_stride, n * row_stride, int(experts.qtype), e, n, k
    if experts.dim() != 3 or not experts.is_contiguous() or experts.dtype not in DENSE_FORMATS:
        raise ValueError(f"dense experts must be a contiguous float32/16 or bfloat16 [E, N, K] tensor, got "
                         f"{experts.dtype} {tuple(experts.shape)}")
    e, n, k = experts.shape
    return experts, experts, k, n * k, DENSE_FORMATS[experts.dtype], e, n, k


def moe_blocks(pairs: int, n: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small tiles under the interpreter (it pays per program and per element)."""
    if interpreting():
        return 16, 64, 64
    block_m = 16 if pairs <= 64 else 64
    return block_m, 64 if n >= 64 else 32, 64


def grouped_gemm(
    a: torch.Tensor, experts: QTensor | torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
    pairs: int, top_k: int, a_per_pair: bool, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32, block_m: int = 16, block_n: int = 32, block_k: int = 32,
) -> torch.Tensor:
    """``out [pairs, N]``: row p is ``A_p @ W_e.T (+ b_e) (* scale_p)`` for pair p's expert e, where A_p is row p of
    `a` (`a_per_pair`) or row ``p // top_k`` (its token); `sorted_pairs`/`block_experts` from `align_pairs`."""
    data, halves, row_stride, expert_stride, fmt, _, n, k = _expert_operands(experts)
    if a.dim() != 2 or a.shape[1] != k:
        raise ValueError(f"grouped_gemm: a must be [M, {k}] for experts [E, {n}, {k}], got {tuple(a.shape)}")
    a = a if a.stride(1) == 1 else a.contiguous()
    out = torch.empty((pairs, n), device=a.device, dtype=torch.float32)
    if pairs == 0:
        return out
    block_k = max(block_k, sub_block_size(fmt))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, data, halves, bias if bias is not None else out, scale if scale is not None else out, out,
        sorted_pairs, block_experts, pairs, n, k, top_k, a.stride(0), out.stride(0), row_stride, expert_stride,
        bias.stride(0) if bias is not None else 0,
        FMT=fmt, SUB=sub_block_size(fmt), A_PER_PAIR=a_per_pair, HAS_BIAS=bias is not None,
        SCALE_ROWS=scale is not None, COMPUTE_DTYPE=tl_dtype(compute_dtype, "fused_moe compute dtype"),
        EMULATE=interpreting(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


def activate(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """``[P, 2I]`` -> ``[P, I]``: silu(gate) * up, gpt-oss's clamped SwiGLU, or gelu_tanh(gate) * up (Gemma 4; see
    `gpullama.ops.experts`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up.clamp(-limit, limit) + 1)
    return torch.nn.functional.silu(gate) * up


def fused_moe(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QTensor | torch.Tensor,
    down: QTensor | torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
    activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, compute_dtype: torch.dtype = torch.float32,
    block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
) -> torch.Tensor:
    """The MoE block ``[T, H]`` float32: for each token, the sum over its k experts of weight times
    ``down_e(act(gate_up_e x + b1_e)) + b2_e``. Experts stacked ``[E, 2I, H]`` and ``[E, H, I]``."""
    t, top_k = ids.shape
    num_experts = gate_up.shape[0]
    pairs = t * top_k
    auto_m, auto_n, auto_k = moe_blocks(pairs, gate_up.shape[1], x.device)
    bm, bn, bk = block_m or auto_m, block_n or auto_n, block_k or auto_k
    sorted_pairs, block_experts = align_pairs(ids, num_experts, bm)
    h = grouped_gemm(x.float(), gate_up, sorted_pairs, block_experts, pairs, top_k, False, gate_up_bias, None,
                     compute_dtype, bm, bn, bk)
    h = activate(h, activation, alpha, limit)
    y = grouped_gemm(h, down, sorted_pairs, block_experts, pairs, top_k, True, down_bias,
                     weights.reshape(-1).float().contiguous(), compute_dtype, bm, bn, bk)
    return y.view(t, top_k, -1).sum(dim=1)
