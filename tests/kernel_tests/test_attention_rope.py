"""Rotary + paged KV write, and paged attention (decode and prefill) against TorchOps."""

from __future__ import annotations

import pytest
import torch

from gpullama.kernels.attention import paged_attention
from gpullama.ops import TorchOps, rope_cos_sin
from gpullama.ops.rope import mrope_axes, mrope_rows
from gpullama.ops.triton_ops import TritonOps
from tests.kernel_tests.batches import make_batch, meta_to

CPU = torch.device("cpu")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return float((got.cpu().double() - want.cpu().double()).abs().max() / want.abs().max())


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("llama3_factors", [False, True])
def test_rope_and_cache_matches_torch(cache_dtype, llama3_factors, device):
    """Rotated q, k (strided views of one qkv) and the pool contents equal TorchOps'."""
    hq, hk, d, block_size = 4, 2, 32, 4
    meta = make_batch([7, 3, 9], [2, 3, 1], block_size, num_blocks=8)
    t = meta.positions.shape[0]
    factors = torch.linspace(1.0, 8.0, d // 2) if llama3_factors else None
    cos_sin = rope_cos_sin(d, 16, 10000.0, factors)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(1))
    q, k, v = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), qkv[:, (hq + hk) * d :].view(t, hk, d)
    pools = [torch.randn(8, block_size, hk, d).to(cache_dtype) for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    want_q, want_k = TorchOps(CPU).rope_and_cache(q.clone(), k.clone(), v, cos_sin, *want_pools, meta)
    qkv_dev = qkv.to(device)
    q2, k2, v2 = (qkv_dev[:, : hq * d].view(t, hq, d), qkv_dev[:, hq * d : (hq + hk) * d].view(t, hk, d),
                  qkv_dev[:, (hq + hk) * d :].view(t, hk, d))
    got_pools = [p.to(device) for p in pools]
    got_q, got_k = TritonOps(device).rope_and_cache(q2, k2, v2, cos_sin.to(device), *got_pools, meta_to(meta, device))
    assert rel_err(got_q, want_q) < 1e-5 and rel_err(got_k, want_k) < 1e-5
    for got, want in zip(got_pools, want_pools):
        # written slots hold the same values rounded to the pool dtype (bf16 may differ by one rounding step
        # where float32 rotations differ in the last bit); untouched slots are unchanged
        assert rel_err(got, want) < (1e-6 if cache_dtype == torch.float32 else 2**-8)


def test_rope_and_cache_partial_rotary_longrope(device):
    """Partial rotary (16 of 32 dims, LongRoPE factors and attention factor in the table): the rotated dims, the
    untouched ones and the pool equal TorchOps'."""
    hq, hk, d, r, block_size = 4, 2, 32, 16, 4
    meta = make_batch([7, 3], [3, 3], block_size, num_blocks=6)
    t = meta.positions.shape[0]
    cos_sin = rope_cos_sin(r, 16, 10000.0, torch.linspace(1.0, 6.0, r // 2), attn_factor=1.3)
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(t, hq, d, generator=g), torch.randn(t, hk, d, generator=g), torch.randn(t, hk, d, generator=g)
    pools = [torch.randn(6, block_size, hk, d, generator=g) for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    want_q, want_k = TorchOps(CPU).rope_and_cache(q.clone(), k.clone(), v, cos_sin, *want_pools, meta)
    got_pools = [p.to(device) for p in pools]
    got_q, got_k = TritonOps(device).rope_and_cache(q.to(device), k.to(device), v.to(device), cos_sin.to(device),
                                                    *got_pools, meta_to(meta, device))
    assert rel_err(got_q, want_q) < 1e-5 and rel_err(got_k, want_k) < 1e-5
    assert torch.equal(got_q[..., r:].cpu(), q[..., r:])  # the unrotated dims stay as they were
    for got, want in zip(got_pools, want_pools):
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("interleaved", [False, True], ids=["runs", "interleaved"])
def test_rope_and_cache_reads_mrope_rows(interleaved, device):
    """M-RoPE (Qwen2-VL's images, in runs; Qwen3-VL's, interleaved): each row's own cos|sin row
    (`BatchMetadata.rope_table`, its frequencies from three positions by section) in place of the table at its
    position, as TorchOps and the C kernels read it."""
    hq, hk, d, block_size = 4, 2, 16, 4
    meta = make_batch([7, 3], [3, 3], block_size, num_blocks=6)
    t = meta.positions.shape[0]
    table = rope_cos_sin(d, 32, 10000.0)
    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 32, (3, t), generator=g)  # time, row, column positions of each row
    meta.rope_table = mrope_rows(table, positions, mrope_axes((3, 3, 2) if interleaved else (2, 3, 3), interleaved))
    meta.rope_index = torch.arange(t)
    q, k, v = torch.randn(t, hq, d, generator=g), torch.randn(t, hk, d, generator=g), torch.randn(t, hk, d, generator=g)
    pools = [torch.randn(6, block_size, hk, d, generator=g) for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    want_q, want_k = TorchOps(CPU).rope_and_cache(q.clone(), k.clone(), v, table, *want_pools, meta)
    plain_q, _ = TorchOps(CPU).rope_and_cache(q.clone(), k.clone(), v, table, *[p.clone() for p in pools],
                                              make_batch([7, 3], [3, 3], block_size, num_blocks=6))
    assert rel_err(plain_q, want_q) > 1e-2  # the rows' own angles, not their positions'
    got_pools = [p.to(device) for p in pools]
    got_q, got_k = TritonOps(device).rope_and_cache(q.to(device), k.to(device), v.to(device), table.to(device),
                                                    *got_pools, meta_to(meta, device))
    assert rel_err(got_q, want_q) < 1e-5 and rel_err(got_k, want_k) < 1e-5
    for got, want in zip(got_pools, want_pools):
        assert rel_err(got, want) < 1e-6


def _attention_case(seq_lens, q_lens, hq, hk, d, block_size, cache_dtype, device, window=0, softcap=0.0,
                    sinks=None, **kernel_args):
    """(kernel output, TorchOps output) for one random batch."""
    meta = make_batch(seq_lens, q_lens, block_size, num_blocks=sum(-(-s // block_size) for s in seq_lens) + 3, seed=2)
    g = torch.Generator().manual_seed(3)
    num_blocks = int(meta.block_tables.max()) + 4
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(cache_dtype)
    q = torch.randn(meta.positions.shape[0], hq, d, generator=g)
    want = TorchOps(CPU).attention(q, k_cache, v_cache, meta, d**-0.5, window, softcap, sinks)
    m = meta_to(meta, device)
    got = paged_attention(q.to(device), k_cache.to(device), v_cache.to(device), m.block_tables, m.seq_lens,
                          m.query_start_loc, m.max_query_len, d**-0.5, window=window, softcap=softcap,
                          sinks=None if sinks is None else sinks.to(device), **kernel_args)
    return got, want


@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_torch(hq, hk, num_splits, device):
    """One new token per sequence, contexts across several blocks and splits (some splits empty)."""
    got, want = _attention_case([1, 13, 37], [1, 1, 1], hq, hk, 32, 4, torch.float32, device,
                                num_splits=num_splits, block_n=16)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_attention_16bit_pool(cache_dtype, device):
    """A 16-bit pool stays within 1e-2 of the float32 reference."""
    got, want = _attention_case([9, 20], [1, 1], 8, 2, 64, 8, cache_dtype, device, num_splits=2, block_n=16)
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("block_n", [16, 32])
def test_prefill_attention_with_cached_prefix(block_n, device):
    """Varlen causal prefill: fresh prompts, prompts after a cached prefix, and a decode row in one batch."""
    got, want = _attention_case([5, 21, 30, 11], [5, 9, 1, 11], 6, 2, 16, 4, torch.float32, device, block_n=block_n)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (0, 2.0), (7, 2.0)], ids=["window", "softcap", "both"])
def test_decode_attention_window_softcap(window, softcap, device):
    """Sliding window (contexts shorter and longer than it) and soft-capped scores, over several splits."""
    got, want = _attention_case([3, 13, 37], [1, 1, 1], 6, 2, 32, 4, torch.float32, device, window=window,
                                softcap=softcap, num_splits=3, block_n=16)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (0, 2.0), (6, 2.0), (1, 0.0)],
                         ids=["window", "softcap", "both", "window1"])
def test_prefill_attention_window_softcap(window, softcap, device):
    """Windowed and soft-capped prefill: fresh prompts, a chunk after a cached prefix, a decode row."""
    got, want = _attention_case([5, 21, 30], [5, 9, 1], 4, 2, 16, 4, torch.float32, device, window=window,
                                softcap=softcap, block_n=16)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("window", [0, 5])
def test_attention_sinks_decode_and_prefill(window, device):
    """gpt-oss's sinks (one logit per query head, some far above the scores): decode over several splits (one
    empty) and prefill with a cached prefix, with and without a window."""
    sinks = torch.tensor([0.5, -1.0, 3.0, 8.0, -20.0, 0.0])
    got, want = _attention_case([3, 13, 37], [1, 1, 1], 6, 2, 32, 4, torch.float32, device, window=window,
                                sinks=sinks, num_splits=3, block_n=16)
    assert rel_err(got, want) < 1e-5
    got, want = _attention_case([5, 21, 30], [5, 9, 1], 6, 2, 16, 4, torch.float32, device, window=window,
                                sinks=sinks, block_n=16)
    assert rel_err(got, want) < 1e-5
    plain, _ = _attention_case([5, 21, 30], [5, 9, 1], 6, 2, 16, 4, torch.float32, device, window=window,
                               block_n=16)
    assert rel_err(plain, want) > 1e-2  # the sinks matter


def test_prefill_attention_16bit_pool_odd_head_dim(device):
    """Head dim 48 (padded to 64 in registers) with a bf16 pool."""
    got, want = _attention_case([19, 7], [19, 4], 4, 1, 48, 8, torch.bfloat16, device, block_n=16)
    assert rel_err(got, want) < 1e-2


def test_attention_rejects_mismatched_pool(device):
    """kv heads that do not divide the query heads are a ValueError naming the shapes."""
    q = torch.zeros(1, 6, 16, device=device)
    pool = torch.zeros(2, 4, 4, 16, device=device)
    meta = meta_to(make_batch([1], [1], 4, 2), device)
    with pytest.raises(ValueError, match="Hk dividing 6"):
        paged_attention(q, pool, pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, 1, 0.25)


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([9, 20, 3], [1, 1, 1]), ([9, 20, 3], [4, 20, 1])],
                         ids=["decode", "prefill"])
def test_latent_rope_cache_and_attention_match_torch(seq_lens, q_lens, device):
    """Multi-head latent attention's ops (DeepSeek): queries and one row a token (16 rotary dims | 32 latent: a
    48-wide row, not a power of two) rotated, the rows written into the one-head pool (no value pool), then every
    head's attention over those rows with the latent as values: the rotary kernel without its value write and the
    paged attention kernels with the pool as keys and values, against TorchOps' latent ops."""
    hq, r, lora, block_size = 4, 16, 32, 4
    d = r + lora
    meta = make_batch(seq_lens, q_lens, block_size, num_blocks=16, seed=4)
    t = meta.positions.shape[0]
    g = torch.Generator().manual_seed(6)
    cos_sin = rope_cos_sin(r, 32, 10000.0)
    q, rows = torch.randn(t, hq, d, generator=g), torch.randn(t, 1, d, generator=g)
    pool = torch.randn(16, block_size, 1, d, generator=g)
    want_pool, got_pool = pool.clone(), pool.to(device)
    torch_ops, triton_ops = TorchOps(CPU), TritonOps(device)
    want_q = torch_ops.latent_rope_and_cache(q.clone(), rows.clone(), cos_sin, want_pool, meta)
    m = meta_to(meta, device)
    got_q = triton_ops.latent_rope_and_cache(q.to(device), rows.to(device), cos_sin.to(device), got_pool, m)
    assert rel_err(got_q, want_q) < 1e-5 and rel_err(got_pool, want_pool) < 1e-6
    want = torch_ops.latent_attention(want_q, want_pool, meta, d**-0.5, r)
    got = triton_ops.latent_attention(got_q, got_pool, m, d**-0.5, r)
    assert want.shape == got.shape == (t, hq, lora)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([5, 1, 9, 2], [5, 1, 2, 1]), ([7, 1, 3], [1, 1, 1])],
                         ids=["prefill", "decode"])
def test_short_conv_matches_torch(seq_lens, q_lens, device):
    """LFM2's short convolution (kernel 3, 40 channels over 16-channel programs): chunks after earlier ones (their
    inputs from the state slot, one chunk shorter than the state), a fresh sequence at position 0, decode rows; the
    outputs and the updated slots against TorchOps' (slots no sequence holds untouched)."""
    h, lk = 40, 3
    meta = make_batch(seq_lens, q_lens, 4, num_blocks=16, seed=1)
    meta.state_slots = torch.tensor([3, 0, 4, 1][: len(seq_lens)])
    g = torch.Generator().manual_seed(2)
    x, kernel = torch.randn(meta.positions.shape[0], h, generator=g), torch.randn(lk, h, generator=g)
    states = torch.randn(6, lk - 1, h, generator=g)
    want_states, got_states = states.clone(), states.to(device)
    want = TorchOps(CPU).short_conv(x, kernel, want_states, meta)
    got = TritonOps(device).short_conv(x.to(device), kernel.to(device), got_states, meta_to(meta, device))
    assert rel_err(got, want) < 1e-5 and rel_err(got_states, want_states) < 1e-6
    assert torch.equal(got_states.cpu()[[2, 5]], states[[2, 5]])


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([6, 9], [6, 3]), ([7, 1, 3], [1, 1, 1])], ids=["prefill", "decode"])
def test_gated_delta_rule_matches_torch(seq_lens, q_lens, device):
    """Qwen3.5's gated delta rule (2 key heads for 4 value heads, key dim 16, value dim 24 over 16-column programs
    wide enough for two: a partial column group): a fresh sequence at position 0, a chunk after earlier rows (its
    state from the slot), decode rows; q, k, v strided views of one row; the outputs and the updated slots against
    TorchOps' (slots no sequence holds untouched)."""
    hk, hv, dk, dv = 2, 4, 16, 24
    meta = make_batch(seq_lens, q_lens, 4, num_blocks=16, seed=1)
    meta.state_slots = torch.tensor([3, 0, 4][: len(seq_lens)])
    t = meta.positions.shape[0]
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, 2 * hk * dk + hv * dv, generator=g)
    decay, beta = -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
    states = torch.randn(6, hv, dk, dv, generator=g) * 0.3

    def split(x):
        return x[:, : hk * dk].view(t, hk, dk), x[:, hk * dk : 2 * hk * dk].view(t, hk, dk), x[:, 2 * hk * dk :].view(
            t, hv, dv)

    want_states, got_states = states.clone(), states.to(device)
    want = TorchOps(CPU).gated_delta_rule(*split(qkv), decay, beta, want_states, meta)
    got = TritonOps(device).gated_delta_rule(*split(qkv.to(device)), decay.to(device), beta.to(device), got_states,
                                             meta_to(meta, device))
    assert rel_err(got, want) < 1e-5 and rel_err(got_states, want_states) < 1e-5
    untouched = [s for s in range(6) if s not in meta.state_slots.tolist()]
    assert torch.equal(got_states.cpu()[untouched], states[untouched])


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([6, 9], [6, 3]), ([7, 1, 3], [1, 1, 1])], ids=["prefill", "decode"])
def test_ssm_scan_matches_torch(seq_lens, q_lens, device):
    """Mamba2's selective scan (4 heads in 2 groups, head dim 24 over 16-column programs wide enough for two: a
    partial column group; state size 16): a fresh sequence at position 0, a chunk after earlier rows (its state
    from the slot), decode rows; x, B and C strided views of one row; the outputs and the updated slots against
    TorchOps' (slots no sequence holds untouched)."""
    heads, groups, p, n = 4, 2, 24, 16
    meta = make_batch(seq_lens, q_lens, 4, num_blocks=16, seed=1)
    meta.state_slots = torch.tensor([3, 0, 4][: len(seq_lens)])
    t = meta.positions.shape[0]
    g = torch.Generator().manual_seed(3)
    xbc = torch.randn(t, heads * p + 2 * groups * n, generator=g)
    dt, a = torch.rand(t, heads, generator=g), -torch.rand(heads, generator=g) - 0.5
    states = torch.randn(6, heads, n, p, generator=g) * 0.3

    def split(v):
        return v[:, : heads * p].view(t, heads, p), v[:, heads * p : heads * p + groups * n].view(t, groups, n), \
            v[:, heads * p + groups * n :].view(t, groups, n)

    want_states, got_states = states.clone(), states.to(device)
    x, b, c = split(xbc)
    want = TorchOps(CPU).ssm_scan(x, dt, a, b, c, want_states, meta)
    x, b, c = split(xbc.to(device))
    got = TritonOps(device).ssm_scan(x, dt.to(device), a.to(device), b, c, got_states, meta_to(meta, device))
    assert rel_err(got, want) < 1e-5 and rel_err(got_states, want_states) < 1e-5
    untouched = [s for s in range(6) if s not in meta.state_slots.tolist()]
    assert torch.equal(got_states.cpu()[untouched], states[untouched])
