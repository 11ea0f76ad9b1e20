"""The gated delta rule (Qwen3.5's linear attention) over each sequence's new rows and its state slot.

Layout: q, k ``[T, Hk, Dk]`` and v ``[T, Hv, Dv]`` (row-strided views, unit stride inside a row), decay and beta
``[T, Hv]`` float32, states ``[slots, Hv, Dk, Dv]`` float32, ``slots [B]`` int64; value head h reads key head
h mod Hk (llama.cpp's converter orders the value heads so). q and k are L2-normalized (``1 / sqrt(sum x^2 + 1e-6)``)
and q scaled by Dk^-0.5; then for each row in turn a head's state S ``[Dk, Dv]`` (zeros for a sequence whose first
row is at position 0) becomes ``S * exp(decay)``, then ``S + k (beta (v - k S))^T``, and the row's output is q S.

Grid ``(B, Hv, cdiv(Dv, BLOCK_V))``: the columns of S evolve on their own, so a program keeps a ``[Dk, BLOCK_V]``
tile of one head's state in registers and walks its sequence's rows in order (the recurrent form, for decode and
prefill alike: sequential over a chunk's rows, parallel over sequences, heads and value columns), storing the tile
back after the last row. Every size comes from tensors, so a decode step with it is captured in a CUDA graph.
Torch reference: `TorchOps.gated_delta_rule` (its chunked form for prefill: the same sums regrouped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import pow2, scan_inputs


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, states_ptr, slots_ptr, positions_ptr, query_start_ptr, out_ptr,
    ldq, ldk, ldv, HK, HV, DK, DV, scale, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One sequence's rows for one value head and BLOCK_V of its columns, in order; then its state tile."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    rows_ok, cols_ok = rows < DK, cols < DV
    first = tl.load(query_start_ptr + b)
    end = tl.load(query_start_ptr + b + 1)
    if end > first:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        tile = states_ptr + ((slot * HV + h) * DK) * DV + rows[:, None] * DV + cols[None, :]
        tile_ok = rows_ok[:, None] & cols_ok[None, :]
        state = tl.load(tile, mask=tile_ok, other=0.0)
        # a fresh sequence (its first row at position 0) starts from zeros, whatever the slot holds
        state = tl.where(tl.load(positions_ptr + first) > 0, state, 0.0)
        key_head = h % HK
        for row in range(first.to(tl.int64), end.to(tl.int64)):
            q = tl.load(q_ptr + row * ldq + key_head * DK + rows, mask=rows_ok, other=0.0)
            k = tl.load(k_ptr + row * ldk + key_head * DK + rows, mask=rows_ok, other=0.0)
            q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
            state = state * tl.exp(tl.load(decay_ptr + row * HV + h))
            recalled = tl.sum(state * k[:, None], axis=0)
            v = tl.load(v_ptr + row * ldv + h * DV + cols, mask=cols_ok, other=0.0)
            delta = (v - recalled) * tl.load(beta_ptr + row * HV + h)
            state = state + k[:, None] * delta[None, :]
            out = tl.sum(state * q[:, None], axis=0)
            tl.store(out_ptr + (row * HV + h) * DV + cols, out, mask=cols_ok)
        tl.store(tile, state, mask=tile_ok)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     query_start: torch.Tensor) -> torch.Tensor:
    """The gated delta rule (see the module's layout), float32 ``[T, Hv, Dv]``; `states` updated in place."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or states.shape[1:] != (hv, dk, dv) or hv % hk:
        raise ValueError(f"gated_delta_rule: q, k [T, Hk, Dk], v [T, Hv, Dv] with Hk dividing Hv, states [slots, Hv, "
                         f"Dk, Dv]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(states.shape)}")
    q, k, v = scan_inputs("gated_delta_rule", states, q, k, v)
    decay, beta = decay.float().contiguous(), beta.float().contiguous()
    out = torch.empty((t, hv, dv), dtype=torch.float32, device=v.device)
    b = slots.shape[0]
    if t and b:
        block_v = min(pow2(dv, 16), 32)
        _gated_delta_rule_kernel[(b, hv, triton.cdiv(dv, block_v))](
            q, k, v, decay, beta, states, slots, positions, query_start, out, q.stride(0), k.stride(0), v.stride(0),
            hk, hv, dk, dv, dk**-0.5, BLOCK_K=pow2(dk, 16), BLOCK_V=block_v, num_warps=4,
        )
    return out
