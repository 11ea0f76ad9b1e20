"""Attention over the paged KV pool ``[num_blocks, block_size, Hk, D]``: split-K decode and varlen causal prefill.

Token ``p`` of sequence b lives at block ``block_tables[b, p // block_size]``, offset ``p % block_size``; every
kernel gathers its k/v rows per token through the block table, so any block_size works with any tile.

- Decode (every sequence adds one token): flash-decoding. Grid ``(B, Hk, num_splits)``; a program packs the
  ``Hq / Hk`` query heads of one kv head into a ``[BLOCK_G >= 16, D]`` tile (GQA: each k/v tile is read once
  for the whole group), takes the split's share ``cdiv(seq_len, num_splits)`` of the context and runs an online
  softmax over BLOCK_N-token tiles with `tl.dot`. It writes the split's normalized partial output and its
  log-sum-exp; `_combine_kernel` (grid ``(B, Hq)``) merges the splits. num_splits depends only on B and Hk
  (never on the context lengths), so the launch is the same at every step and can be captured in a CUDA graph.
- Prefill / mixed batches: grid ``(cdiv(max_query_len, BLOCK_M), B, Hq)``; a program takes BLOCK_M queries of
  one head, the bottom-right aligned causal mask (query j of a sequence of q_len new tokens sits at position
  ``seq_len - q_len + j``), and walks keys from 0 (cached prefix included) up to its last query's position.
Sliding window: a query at position p sees keys above ``p - WINDOW`` only (full-attention layers pass WINDOW =
NO_WINDOW, beyond any context, so one code path serves both); decode splits the window's span instead of the
whole context, prefill starts its key walk at the first key its first query sees.
Soft-capping (HAS_SOFTCAP, Gemma 2): scores become ``SOFTCAP * tanh(scores / SOFTCAP)`` before the mask.
Attention sinks (HAS_SINKS, gpt-oss): head h's softmax also counts ``exp(sinks[h])``, a key without a value: the
prefill kernel adds it after its key walk, decode when the combine merges the splits.
Scores and softmax are float32; 16-bit pools multiply in their dtype. Torch reference: `TorchOps.attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.common import dot, interpreting, pow2, sm_count, tanh, tl_dtype

NO_WINDOW = 1 << 30
"""The WINDOW of a full-attention layer: larger than any context (and far from int32 overflow)."""


@triton.jit
def _load_kv(cache_ptr, block_table_row, pos, valid, kvh, block_size, stride_b, stride_s, stride_h, dims, D):
    """``[BLOCK_N, BLOCK_D]`` k or v rows of context positions `pos` of one kv head, gathered through the block table."""
    block = tl.load(block_table_row + pos // block_size, mask=valid, other=0).to(tl.int64)
    rows = block * stride_b + (pos % block_size) * stride_s + kvh * stride_h
    return tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=valid[:, None] & (dims[None, :] < D), other=0.0)


@triton.jit
def _capped(s, SOFTCAP, HAS_SOFTCAP: tl.constexpr):
    """Scores soft-capped at ``SOFTCAP * tanh(s / SOFTCAP)`` when HAS_SOFTCAP."""
    if HAS_SOFTCAP:
        return SOFTCAP * tanh(s / SOFTCAP)
    else:
        return s


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, part_out_ptr, part_lse_ptr,
    scale, GROUP, D, block_size, num_splits, WINDOW, SOFTCAP,
    stride_qt, stride_qh, stride_bt, stride_cb, stride_cs, stride_ch,
    DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One split of one sequence's context (of its window's span, on a sliding layer) for the query heads of one
    kv head."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    token = tl.load(query_start_ptr + b).to(tl.int64)
    lo = tl.maximum(seq_len - WINDOW, 0)  # the first key the new token sees
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=g_mask[:, None] & (dims[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _load_kv(k_cache_ptr, table_row, pos, valid, kvh, block_size, stride_cb, stride_cs, stride_ch, dims, D)
        s = _capped(dot(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_N], tl.float32), DOT_DTYPE, EMULATE) * scale,
                    SOFTCAP, HAS_SOFTCAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv(v_cache_ptr, table_row, pos, valid, kvh, block_size, stride_cb, stride_cs, stride_ch, dims, D)
        acc = dot(p, v, acc * alpha[:, None], DOT_DTYPE, EMULATE)
        m_i = m_new
    part = (b * tl.num_programs(1) * GROUP + heads).to(tl.int64) * num_splits + split
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(part_out_ptr + part[:, None] * D + dims[None, :], out, mask=g_mask[:, None] & (dims[None, :] < D))
    tl.store(part_lse_ptr + part, tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf")), mask=g_mask)


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, query_start_ptr, D, num_splits, stride_ot, stride_oh,
    HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the splits of one (sequence, query head) by their log-sum-exp weights (and the head's sink)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = (b * tl.num_programs(1) + h).to(tl.int64) * num_splits
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + part + splits, mask=splits < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        top = tl.maximum(top, sink)
    weights = tl.exp(lse - top)
    total = tl.sum(weights, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    parts = tl.load(part_out_ptr + (part + splits)[:, None] * D + dims[None, :],
                    mask=(splits[:, None] < num_splits) & (dims[None, :] < D), other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / total
    token = tl.load(query_start_ptr + b).to(tl.int64)
    width = tl.where(tl.load(query_start_ptr + b + 1) > token, D, 0)  # a sequence without a new token writes nothing
    tl.store(out_ptr + token * stride_ot + h * stride_oh + dims, out, mask=dims < width)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, sinks_ptr, out_ptr,
    scale, GROUP, D, block_size, WINDOW, SOFTCAP,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """BLOCK_M new tokens of one sequence and one query head against their causal (windowed) context."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs < q_len
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims[None, :] < D
    tokens = (q_start + offs).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + h * stride_qh + dims[None, :],
                mask=m_mask[:, None] & d_mask, other=0.0)
    q_pos = seq_len - q_len + offs  # context position of each query
    end = tl.where(pid_m * BLOCK_M < q_len, tl.minimum(seq_len, seq_len - q_len + (pid_m + 1) * BLOCK_M), 0)
    # a sliding layer: keys from the first one the block's first query sees
    start = tl.maximum(seq_len - q_len + pid_m * BLOCK_M - WINDOW + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _load_kv(k_cache_ptr, table_row, pos, valid, kvh, block_size, stride_cb, stride_cs, stride_ch, dims, D)
        s = _capped(dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_DTYPE, EMULATE) * scale,
                    SOFTCAP, HAS_SOFTCAP)
        seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(valid[None, :] & seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv(v_cache_ptr, table_row, pos, valid, kvh, block_size, stride_cb, stride_cs, stride_ch, dims, D)
        acc = dot(p, v, acc * alpha[:, None], DOT_DTYPE, EMULATE)
        m_i = m_new
    if HAS_SINKS:  # the sink joins the softmax as one more score, with no value
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + h * stride_oh + dims[None, :], out, mask=m_mask[:, None] & d_mask)


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Context splits per (sequence, kv head): enough programs to fill the device twice, at most 16."""
    return max(1, min(16, triton.cdiv(2 * sm_count(device), max(num_seqs * num_kv_heads, 1))))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens ``q [T, Hq, D]`` over their paged context: float32 ``[T, Hq, D]``;
    `window` > 0 limits each query to its last `window` positions, `softcap` > 0 soft-caps the scores, `sinks`
    ``[Hq]`` adds each head's sink logit to its softmax."""
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.is_contiguous()):
        raise ValueError(f"attention: sinks must be a contiguous [{q.shape[1]}] vector, got {tuple(sinks.shape)}")
    t, hq, d = q.shape
    num_blocks, block_size, hk, d_cache = k_cache.shape
    if d_cache != d or hq % hk or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"attention: q {tuple(q.shape)} needs pools [*, *, Hk dividing {hq}, {d}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("attention: q and the pools need a unit last stride")
    b = seq_lens.shape[0]
    out = torch.empty((t, hq, d), device=q.device, dtype=torch.float32)
    if t == 0 or b == 0:
        return out
    dot_dtype = tl.float32 if k_cache.dtype == torch.float32 else tl_dtype(k_cache.dtype, "attention KV pool")
    group = hq // hk
    block_d = pow2(d, 16)
    if window < 0 or softcap < 0:
        raise ValueError(f"attention: window and softcap must be >= 0 (0: off), got {window}, {softcap}")
    common = dict(DOT_DTYPE=dot_dtype, EMULATE=interpreting(), HAS_SOFTCAP=softcap > 0)
    sinks_arg = sinks if sinks is not None else out
    span = int(window) if window else NO_WINDOW
    if max_query_len == 1:
        splits = num_splits or decode_splits(b, hk, q.device)
        block_n = block_n or 64
        part_out = torch.empty((b, hq, splits, d), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((b, hq, splits), device=q.device, dtype=torch.float32)
        _decode_kernel[(b, hk, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, part_out, part_lse,
            scale, group, d, block_size, splits, span, float(softcap or 1.0),
            q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_G=pow2(group, 16), BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4, **common,
        )
        _combine_kernel[(b, hq)](
            part_out, part_lse, sinks_arg, out, query_start_loc, d, splits, out.stride(0), out.stride(1),
            HAS_SINKS=sinks is not None, BLOCK_S=pow2(splits), BLOCK_D=block_d, num_warps=1,
        )
        return out
    block_m = 16 if max_query_len <= 16 else 64
    block_n = block_n or 64
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), b, hq)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks_arg, out,
        scale, group, d, block_size, span, float(softcap or 1.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HAS_SINKS=sinks is not None, num_warps=4, **common,
    )
    return out
