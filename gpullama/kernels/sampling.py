"""Next-token sampling on the device: greedy argmax, or temperature / top-k / top-p / min-p over each row.

Grid ``(B,)``: one program per row of ``[B, V]`` logits walks the vocab in BLOCK_V chunks, never sorting:
1. max and first argmax of the logits (the answer when temperature <= 0);
2. ``e = exp((logit - max) / temperature)`` into a float32 scratch row (the largest e is exactly 1);
3. the top-k threshold ``t_k`` = the k-th largest e, found by bisection on the float32 bit pattern (31 passes,
   exact); min-p keeps ``e >= min_p``; the top-p threshold ``t_p`` = the largest e such that the mass of
   ``{e >= t_p}`` among the tokens top-k and min-p keep is at least ``top_p`` of their mass (31 more passes),
   which is vLLM's order (min-p, top-k, then top-p on what is left);
4. one pass that draws the first token whose running sum of kept e exceeds ``uniform * total``.
Ties at a threshold are all kept. The caller gives per-row parameters and per-row uniforms in [0, 1), so a
batch samples with one launch and the result is reproducible. Its reference, by sorting, is in the tests
(`tests/kernel_tests/sampling_reference.py`); `TorchOps.sample` is the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mass_at_least(e_row, threshold, floor, V, BLOCK_V: tl.constexpr):
    """(count, mass) of the e values that are >= max(threshold, floor)."""
    t = tl.maximum(threshold, floor)
    count = tl.zeros([], tl.int32)
    mass = tl.zeros([], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + tl.arange(0, BLOCK_V)
        e = tl.load(e_row + idx, mask=idx < V, other=-1.0)
        keep = e >= t
        count += tl.sum(keep.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(keep, e, 0.0), axis=0)
    return count, mass


@triton.jit
def _sample_kernel(
    logits_ptr, e_ptr, out_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, uniform_ptr,
    V, stride_l, BLOCK_V: tl.constexpr,
):
    """One row: greedy or filtered sampling."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_l
    e_row = e_ptr + row * V
    # 1. max and first argmax
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(logits_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        chunk_idx = tl.min(tl.where(x == chunk_max, idx, V), axis=0)
        better = chunk_max > best
        best_idx = tl.where(better, chunk_idx, best_idx)
        best = tl.maximum(best, chunk_max)
    temperature = tl.load(temperature_ptr + row)
    token = best_idx
    if temperature > 0:
        # 2. unnormalized probabilities
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(logits_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            tl.store(e_row + idx, tl.exp((x - best) / temperature), mask=idx < V)
        # 3. thresholds by bisection over the bit patterns of [0, 1]: lo always satisfies the condition
        top_k = tl.load(top_k_ptr + row)
        t_k = tl.zeros([], tl.float32)
        if (top_k > 0) & (top_k < V):
            lo = tl.zeros([], tl.int32)
            hi = tl.full([], 0x3F800001, tl.int32)  # just above 1.0
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                count, _mass = _mass_at_least(e_row, mid.to(tl.float32, bitcast=True), 0.0, V, BLOCK_V)
                ok = count >= top_k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            t_k = lo.to(tl.float32, bitcast=True)
        # min-p and top-k first; top-p then takes its nucleus of what they keep (vLLM's order)
        floor = tl.maximum(t_k, tl.load(min_p_ptr + row))
        top_p = tl.load(top_p_ptr + row)
        t_p = tl.zeros([], tl.float32)
        if top_p < 1.0:
            _count, mass_k = _mass_at_least(e_row, floor, 0.0, V, BLOCK_V)
            lo = tl.zeros([], tl.int32)
            hi = tl.full([], 0x3F800001, tl.int32)
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                _count, mass = _mass_at_least(e_row, mid.to(tl.float32, bitcast=True), floor, V, BLOCK_V)
                ok = mass >= top_p * mass_k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            t_p = lo.to(tl.float32, bitcast=True)
        threshold = tl.maximum(floor, t_p)
        # 4. inverse CDF over the kept tokens, in vocab order
        _count, total = _mass_at_least(e_row, threshold, 0.0, V, BLOCK_V)
        target = tl.load(uniform_ptr + row) * total
        running = tl.zeros([], tl.float32)
        found = tl.full([], -1, tl.int32)
        last_kept = tl.full([], -1, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + tl.arange(0, BLOCK_V)
            e = tl.load(e_row + idx, mask=idx < V, other=-1.0)
            keep = e >= threshold
            kept = tl.where(keep, e, 0.0)
            cumulative = tl.cumsum(kept, axis=0) + running
            first = tl.min(tl.where(keep & (cumulative > target), idx, V), axis=0)
            found = tl.where((found < 0) & (first < V), first, found)
            last_kept = tl.maximum(last_kept, tl.max(tl.where(keep, idx, -1), axis=0))
            running += tl.sum(kept, axis=0)
        token = tl.where(found >= 0, found, last_kept)
    tl.store(out_ptr + row, token.to(tl.int64))


def _check(logits: torch.Tensor, **params: torch.Tensor) -> None:
    """Shapes of the batch and its per-row parameters."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"sample: logits must be [B, V] with V > 0, got {tuple(logits.shape)}")
    for name, value in params.items():
        if value.shape != (logits.shape[0],):
            raise ValueError(f"sample: {name} must be one value per row, shape ({logits.shape[0]},), got {tuple(value.shape)}")


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    block_v: int = 1024,
) -> torch.Tensor:
    """Token ids ``[B]`` int64: argmax where temperature <= 0, else a draw from the filtered softmax.

    top_k <= 0 or >= V, top_p >= 1 and min_p <= 0 switch that filter off; `uniform` holds one U[0, 1) per row.
    """
    _check(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, uniform=uniform)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    out = torch.empty(b, device=logits.device, dtype=torch.int64)
    scratch = torch.empty((b, v), device=logits.device, dtype=torch.float32)
    if b:
        _sample_kernel[(b,)](
            logits, scratch, out,
            temperature.float().contiguous(), top_k.to(torch.int32).contiguous(), top_p.float().contiguous(),
            min_p.float().contiguous(), uniform.float().contiguous(),
            v, logits.stride(0), BLOCK_V=block_v, num_warps=8,
        )
    return out
