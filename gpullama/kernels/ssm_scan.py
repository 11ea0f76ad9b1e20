"""Mamba2's selective scan (Granite 4.0's state-space layers) over each sequence's new rows and its state slot.

Layout: x ``[T, H, P]`` and b, c ``[T, G, N]`` (row-strided views, each head's or group's values contiguous), dt
``[T, H]`` (after softplus) and a ``[H]`` (negative) float32, states ``[slots, H, N, P]`` float32, ``slots [B]``
int64; head h reads group h // (H / G) (transformers' and ggml's repeat_interleave order). For each row in turn a
head's state S ``[N, P]`` (zeros for a sequence whose first row is at position 0) becomes ``S exp(dt a) + b (dt
x)^T`` and the row's output is ``c S`` (no D skip: the decoder adds it).

Grid ``(B, H, cdiv(P, BLOCK_P))``: the columns of S evolve on their own, so a program keeps an ``[N, BLOCK_P]``
tile of one head's state in registers and walks its sequence's rows in order (the recurrent form, for decode and
prefill alike: sequential over a chunk's rows, parallel over sequences, heads and head columns), storing the tile
back after the last row. Every size comes from tensors, so a decode step with it is captured in a CUDA graph.
Torch reference: `TorchOps.ssm_scan` (its chunked form for prefill: the same sums regrouped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import pow2, scan_inputs


@triton.jit
def _ssm_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, states_ptr, slots_ptr, positions_ptr, query_start_ptr, out_ptr,
    ldx, ldb, ldc, H, PER_GROUP, P, N, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One sequence's rows for one head and BLOCK_P of its columns, in order; then its state tile."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    rows = tl.arange(0, BLOCK_N)
    rows_ok, cols_ok = rows < N, cols < P
    first = tl.load(query_start_ptr + s)
    end = tl.load(query_start_ptr + s + 1)
    if end > first:
        slot = tl.load(slots_ptr + s).to(tl.int64)
        tile = states_ptr + ((slot * H + h) * N) * P + rows[:, None] * P + cols[None, :]
        tile_ok = rows_ok[:, None] & cols_ok[None, :]
        state = tl.load(tile, mask=tile_ok, other=0.0)
        # a fresh sequence (its first row at position 0) starts from zeros, whatever the slot holds
        state = tl.where(tl.load(positions_ptr + first) > 0, state, 0.0)
        a = tl.load(a_ptr + h)
        group = h // PER_GROUP
        for row in range(first.to(tl.int64), end.to(tl.int64)):
            step = tl.load(dt_ptr + row * H + h)
            x = tl.load(x_ptr + row * ldx + h * P + cols, mask=cols_ok, other=0.0)
            b = tl.load(b_ptr + row * ldb + group * N + rows, mask=rows_ok, other=0.0)
            c = tl.load(c_ptr + row * ldc + group * N + rows, mask=rows_ok, other=0.0)
            state = state * tl.exp(step * a) + b[:, None] * (step * x)[None, :]
            out = tl.sum(state * c[:, None], axis=0)
            tl.store(out_ptr + (row * H + h) * P + cols, out, mask=cols_ok)
        tl.store(tile, state, mask=tile_ok)


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             query_start: torch.Tensor) -> torch.Tensor:
    """Mamba2's selective scan (see the module's layout), float32 ``[T, H, P]``; `states` updated in place."""
    t, heads, p = x.shape
    groups, n = b.shape[1:]
    if c.shape != b.shape or states.shape[1:] != (heads, n, p) or heads % groups or dt.shape != (t, heads):
        raise ValueError(f"ssm_scan: x [T, H, P], dt [T, H], b and c [T, G, N] with G dividing H, states [slots, H, "
                         f"N, P]; got {tuple(x.shape)}, {tuple(dt.shape)}, {tuple(b.shape)}, {tuple(c.shape)}, "
                         f"{tuple(states.shape)}")
    x, b, c = scan_inputs("ssm_scan", states, x, b, c)
    dt, a = dt.float().contiguous(), a.float().contiguous()
    out = torch.empty((t, heads, p), dtype=torch.float32, device=x.device)
    count = slots.shape[0]
    if t and count:
        block_p = min(pow2(p, 16), 32)
        _ssm_scan_kernel[(count, heads, triton.cdiv(p, block_p))](
            x, dt, a, b, c, states, slots, positions, query_start, out, x.stride(0), b.stride(0), c.stride(0),
            heads, heads // groups, p, n, BLOCK_N=pow2(n, 16), BLOCK_P=block_p, num_warps=4,
        )
    return out
