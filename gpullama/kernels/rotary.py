"""Rotary embedding of q and k (NeoX halves) fused with the write of k and v into the paged KV pool.

Grid ``(T,)``: one program per token reads its position and the ``[R]`` cos|sin row of the table (plain,
Llama-3-scaled, LongRoPE or linearly scaled frequencies and LongRoPE's attention factor are baked into the table by
`rope_cos_sin`), rotates the first R dims of all Hq query heads and Hk key heads as ``[heads, R/2]`` halves in
registers, writes q and k back in place, and stores the rotated k and the v of the token at its slot
``slot_mapping[t] = block * block_size + offset`` of the ``[num_blocks, block_size, Hk, D]`` pools (a negative
slot skips the write: padding tokens). R < D is partial rotary (Phi-4-mini): the last ``D - R`` dims of each head
pass through unrotated (HAS_REST copies k's into the pool). Without v (HAS_V false: multi-head latent attention,
whose one row a token is rotary | latent and whose values are that latent) only k is written. Torch reference:
`TorchOps.rope_and_cache` (`TorchOps.latent_rope_and_cache` without v).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import interpreting, pow2, round_to, tl_dtype


@triton.jit
def _rotate_heads(ptr, stride_h, HEADS, cos, sin, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate ``[HEADS, 2 * HALF]`` at `ptr` in place; returns the rotated halves."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < HEADS) & (cols < HALF)
    first = tl.load(ptr + heads * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(ptr + heads * stride_h + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    new_first = first * cos - second * sin
    new_second = second * cos + first * sin
    tl.store(ptr + heads * stride_h + cols, new_first, mask=mask)
    tl.store(ptr + heads * stride_h + HALF + cols, new_second, mask=mask)
    return new_first, new_second, mask


@triton.jit
def _rope_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_sin_ptr, positions_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    HQ, HK, HALF, D, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cb, stride_cs_slot, stride_ch,
    POOL_DTYPE: tl.constexpr, EMULATE: tl.constexpr, HAS_REST: tl.constexpr, HAS_V: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rotate one token's q and k heads in place and write its k (and v, with HAS_V) to the pool."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    half_cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + half_cols, mask=half_cols < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + half_cols, mask=half_cols < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, HQ, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    k_first, k_second, mask = _rotate_heads(k_ptr + t * stride_kt, stride_kh, HK, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_HK)[:, None]
        cols = half_cols[None, :]
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs_slot + heads * stride_ch + cols
        tl.store(k_cache_ptr + dst, round_to(k_first, POOL_DTYPE, EMULATE).to(POOL_DTYPE), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, round_to(k_second, POOL_DTYPE, EMULATE).to(POOL_DTYPE), mask=mask)
        dims = tl.arange(0, BLOCK_D)[None, :]
        row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs_slot + heads * stride_ch
        if HAS_REST:  # k's unrotated dims, as they are
            rest = (heads < HK) & (dims >= 2 * HALF) & (dims < D)
            k_rest = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=rest, other=0.0).to(tl.float32)
            tl.store(k_cache_ptr + row + dims, round_to(k_rest, POOL_DTYPE, EMULATE).to(POOL_DTYPE), mask=rest)
        if HAS_V:
            v_mask = (heads < HK) & (dims < D)
            v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=v_mask, other=0.0).to(tl.float32)
            tl.store(v_cache_ptr + row + dims, round_to(v, POOL_DTYPE, EMULATE).to(POOL_DTYPE), mask=v_mask)


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R dims (`cos_sin` is ``[max_pos, R]``, R <= D) of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in
    place and write k, v into the pools (v and v_cache None: k only); returns (q, k)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    r = cos_sin.shape[1]
    has_v = v is not None
    if not has_v:  # the kernel's v arguments go unread
        v, v_cache = k, k_cache
    if d % 2 or k.shape != (t, hk, d) or v.shape != (t, hk, d):
        raise ValueError(f"rope_and_cache: q [T, Hq, D] and k, v [T, Hk, D] with even D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.shape[2:] != (hk, d) or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"rope_and_cache: pools must both be [num_blocks, block_size, {hk}, {d}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if r > d or r % 2 or cos_sin.dim() != 2 or cos_sin.dtype != torch.float32:
        raise ValueError(f"rope_and_cache: cos_sin must be float32 [max_pos, R] with even R <= {d}, got {cos_sin.dtype} {tuple(cos_sin.shape)}")
    if q.dtype != torch.float32 or k.dtype != torch.float32:
        raise ValueError(f"rope_and_cache: q and k must be float32 (rotated in place), got {q.dtype}, {k.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"rope_and_cache: {name} needs a unit last stride, got strides {x.stride()}")
    if t:
        _rope_and_cache_kernel[(t,)](
            q, k, v, cos_sin, positions, slot_mapping, k_cache, v_cache,
            hq, hk, r // 2, d, k_cache.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            POOL_DTYPE=tl_dtype(k_cache.dtype, "rope_and_cache KV pool"), EMULATE=interpreting(), HAS_REST=r < d,
            HAS_V=has_v,
            BLOCK_HQ=pow2(hq), BLOCK_HK=pow2(hk), BLOCK_HALF=pow2(r // 2), BLOCK_D=pow2(d), num_warps=4,
        )
    return q, k
