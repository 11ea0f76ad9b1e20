"""LFM2's short convolution: a causal depthwise convolution over each sequence's new rows and its state slot.

Layout: x ``[T, H]`` (the rows of B sequences, sequence b's from ``query_start[b]`` on), kernel ``[L, H]`` (tap j
of every channel), states ``[slots, L - 1, H]`` float32 (a sequence's last L - 1 inputs), ``slots [B]`` int64.
Row t of channel c is ``sum_j kernel[j, c] * input[t - L + 1 + j, c]``, where an input before the sequence's first
row comes from its state slot (zero when that first row is at position 0: a fresh sequence), and afterwards the
slot holds the sequence's last L - 1 inputs.

Grid ``(B, cdiv(H, BLOCK_H))``: a program walks its sequence's rows in order for BLOCK_H channels, loading each
row's ``[L, BLOCK_H]`` window (from x, or from the state before the first row) and summing its products with the
kernel tile; last it loads the new state's L - 1 rows, then stores them (loads first: a chunk shorter than L - 1
reads part of the old state). Every size comes from tensors, so a decode step with it is captured in a CUDA graph.
Torch reference: `TorchOps.short_conv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import pow2


@triton.jit
def _inputs(x_ptr, state_ptr, idx, first, state_start, rows_ok, ch, ch_ok, H, L: tl.constexpr):
    """``[L_PAD, BLOCK_H]`` inputs at row indices `idx` (``[L_PAD, 1]``): x's rows from `first` on, the state's
    from `state_start` to it (`first` itself for a fresh sequence: zeros)."""
    from_x = rows_ok & (idx >= first) & ch_ok
    from_state = rows_ok & (idx < first) & (idx >= state_start) & ch_ok
    state_row = (L - 1) - (first - idx)  # idx = first - 1 is the state's last row
    xs = tl.load(x_ptr + idx.to(tl.int64) * H + ch, mask=from_x, other=0.0)
    ss = tl.load(state_ptr + state_row * H + ch, mask=from_state, other=0.0)
    return tl.where(idx >= first, xs, ss)


@triton.jit
def _short_conv_kernel(
    x_ptr, kernel_ptr, states_ptr, slots_ptr, positions_ptr, query_start_ptr, out_ptr, H,
    L: tl.constexpr, L_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One sequence's rows for BLOCK_H channels, in order; then its new state."""
    b = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ch, ch_ok = channels[None, :], (channels < H)[None, :]
    taps = tl.arange(0, L_PAD)[:, None]
    first = tl.load(query_start_ptr + b)
    end = tl.load(query_start_ptr + b + 1)
    if end > first:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        state_ptr = states_ptr + slot * (L - 1) * H
        # the state's rows sit just before `first`; a fresh sequence (first row at position 0) reads none
        state_start = tl.where(tl.load(positions_ptr + first) > 0, first - (L - 1), first)
        kernel = tl.load(kernel_ptr + taps * H + ch, mask=(taps < L) & ch_ok, other=0.0)
        for t in range(first, end):
            window = _inputs(x_ptr, state_ptr, t - (L - 1) + taps, first, state_start, taps < L, ch, ch_ok, H, L)
            out = tl.sum(window * kernel, axis=0)
            tl.store(out_ptr + t * H + channels, out, mask=channels < H)
        new_state = _inputs(x_ptr, state_ptr, end - (L - 1) + taps, first, state_start, taps < L - 1, ch, ch_ok, H, L)
        tl.store(state_ptr + taps * H + ch, new_state, mask=(taps < L - 1) & ch_ok)


def short_conv(x: torch.Tensor, kernel: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor, query_start: torch.Tensor) -> torch.Tensor:
    """The short convolution of ``x [T, H]`` (see the module's layout), float32 ``[T, H]``; `states` updated in
    place."""
    t, h = x.shape
    lk = kernel.shape[0]
    if kernel.shape != (lk, h) or states.shape[1:] != (lk - 1, h) or lk < 2:
        raise ValueError(f"short_conv: kernel [L >= 2, {h}] and states [slots, L - 1, {h}], got {tuple(kernel.shape)}, "
                         f"{tuple(states.shape)}")
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("short_conv: the states must be contiguous float32")
    x, kernel = x.float().contiguous(), kernel.float().contiguous()
    out = torch.empty((t, h), dtype=torch.float32, device=x.device)
    b = slots.shape[0]
    if t and b:
        block_h = min(pow2(h, 16), 256)
        _short_conv_kernel[(b, triton.cdiv(h, block_h))](
            x, kernel, states, slots, positions, query_start, out, h, L=lk, L_PAD=pow2(lk), BLOCK_H=block_h,
            num_warps=4,
        )
    return out
