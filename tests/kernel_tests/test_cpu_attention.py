"""The CPU attention over long contexts (keys cut into chunks of 256, flash-decoding) and its KV cache formats
(float32, float16, Q8_0) against torch references: gguf's Q8_0 quantizer for the cache bytes, `TorchOps`' attention
(float32) for the results, and each row's independence from the batch, the tiling and the thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpullama.kernels import cpu_native
from gpullama.ops import TorchOps, rope_cos_sin
from tests.kernel_tests.test_cpu_native import gen, metadata, transposed

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")

Q8 = GGMLQuantizationType.Q8_0
# max |attention over the Q8_0 cache - attention over the float32 one| for unit-variance keys and values (scale
# 1 / sqrt(head dim)): each value is rounded to 1/254 of its group's largest magnitude. Measured here: 0.017 at most
# with unit-variance queries (head dims 64 to 512); twice the bound for the soft-capped cases' 3x queries (their
# scores' rounding 3x larger: 0.026 at head dim 64, 0.046 at 512).
Q8_ATTENTION_TOLERANCE = 0.03


def q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x's values as gguf's Q8_0 quantizer and dequantizer give them back (rows of 32)."""
    rows = x.reshape(-1, x.shape[-1]).numpy()
    return torch.from_numpy(dequantize(quantize(rows, Q8), Q8).astype(np.float32)).view(x.shape)


def write_pool(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, blocks: int, block_size: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v ``[T, Hk, D]`` written to pool rows `slots` by the kernel in format `dtype` (at position 0, where the
    rotation is the identity): the k and v pools."""
    t, hk, d = k.shape
    row = d + d // 16 if dtype == torch.uint8 else d
    k_cache, v_cache = (torch.zeros(blocks, block_size, hk, row, dtype=dtype) for _ in range(2))
    cpu_native.rope_and_cache(torch.zeros(t, 1, d), k.clone(), v, rope_cos_sin(d, 4, 10000.0),
                              torch.zeros(t, dtype=torch.long), slots, k_cache, v_cache)
    return k_cache, v_cache


def standard_pool(x: torch.Tensor, slots: torch.Tensor, blocks: int, block_size: int) -> torch.Tensor:
    """x ``[T, Hk, D]`` at pool rows `slots` of a float32 pool in the standard layout (`TorchOps`')."""
    pool = torch.zeros(blocks, block_size, *x.shape[1:])
    pool.view(-1, *x.shape[1:])[slots] = x
    return pool


def test_float16_cache_rounds_as_torch_does() -> None:
    k, v = torch.randn(40, 2, 64, generator=gen(1)) * 30, torch.randn(40, 2, 64, generator=gen(2))
    k[0, 0, :4] = torch.tensor([70000.0, 1e-7, -3e-5, 65519.0])  # past the range, subnormal, the rounding edge
    slots = torch.randperm(64, generator=gen(3))[:40]
    k_cache, v_cache = write_pool(k, v, slots, 4, 16, torch.float16)
    assert torch.equal(k_cache, transposed(standard_pool(k, slots, 4, 16).half()))
    assert torch.equal(v_cache, standard_pool(v, slots, 4, 16).half())


def test_q8_0_cache_holds_gguf_blocks() -> None:
    """Each row's int8 values and float16 scales are exactly gguf's Q8_0 blocks of it."""
    t, hk, d, bs, blocks = 40, 2, 64, 16, 4
    k, v = torch.randn(t, hk, d, generator=gen(4)) * 5, torch.randn(t, hk, d, generator=gen(5))
    k[3, 1, :32] = 0.0  # an all-zero group: scale 0
    slots = torch.randperm(blocks * bs, generator=gen(6))[:t]
    k_cache, v_cache = write_pool(k, v, slots, blocks, bs, torch.uint8)
    g = d // 32

    def gguf_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.from_numpy(quantize(x.reshape(-1, d).numpy(), Q8)).view(t, hk, g, 34)
        return raw[..., 2:].reshape(t, hk, d).view(torch.int8), raw[..., :2].reshape(t, hk, 2 * g)

    want_q, want_s = gguf_rows(v)
    rows = v_cache.view(-1, hk, d + d // 16)[slots]
    assert torch.equal(rows[..., :d].view(torch.int8), want_q) and torch.equal(rows[..., d:], want_s)
    # k: per block and kv head, the int8 values [D, block_size], then the scales [D / 32, block_size]
    heads = k_cache.view(blocks, hk, bs * (d + d // 16))
    values = heads[..., :d * bs].view(torch.int8).view(blocks, hk, d, bs).permute(0, 3, 1, 2).reshape(-1, hk, d)
    scales = heads[..., d * bs:].contiguous().view(blocks, hk, g, bs, 2).permute(0, 3, 1, 2, 4).reshape(-1, hk, 2 * g)
    want_q, want_s = gguf_rows(k)
    assert torch.equal(values[slots], want_q) and torch.equal(scales[slots], want_s)


BATCHES = [  # (query lengths, context lengths, blocks of each): contexts across several chunks of 256 keys
    ([1, 1, 1], [700, 257, 1], [list(range(44)), list(range(44, 61)), [61]]),  # decode: split into chunk items
    ([40, 1, 300], [600, 513, 300], [list(range(38)), list(range(38, 71)), list(range(71, 90))]),  # prefill, mixed
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
@pytest.mark.parametrize(("window", "softcap", "sinks"), [(0, 0.0, False), (300, 0.0, True), (0, 5.0, False)])
@pytest.mark.parametrize("d", [64, 384, 512])  # 384, 512: heads wider than the kernel's 256-dim pieces (Gemma 4)
def test_long_context_attention_matches_torch(dtype: torch.dtype, window: int, softcap: float, sinks: bool,
                                              d: int) -> None:
    """Against `TorchOps`' float32 attention over the values the cache holds (float16- or Q8_0-rounded: the same
    to float32 rounding), and, for Q8_0, over the exact float32 values within Q8_ATTENTION_TOLERANCE."""
    hq, hk, bs, blocks, scale = 6, 2, 16, 90, d**-0.5
    ops = TorchOps(torch.device("cpu"))
    for q_lens, seq_lens, tables in BATCHES:
        meta = metadata(q_lens, seq_lens, bs, tables)
        n = blocks * bs
        k, v = torch.randn(n, hk, d, generator=gen(7)), torch.randn(n, hk, d, generator=gen(8))
        slots = torch.arange(n)
        k_cache, v_cache = write_pool(k, v, slots, blocks, bs, dtype)
        held = {torch.float32: lambda x: x, torch.float16: lambda x: x.half().float(), torch.uint8: q8_round_trip}
        q = torch.randn(sum(q_lens), hq, d, generator=gen(9)) * (3.0 if softcap else 1.0)
        sink = torch.randn(hq, generator=gen(10)) if sinks else None
        if sinks:
            got = cpu_native.attention_sinks(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                             meta.block_tables, scale, torch.empty_like(q), window, softcap, sink)
        else:
            got = cpu_native.attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       scale, torch.empty_like(q), window, softcap)
        ref_k, ref_v = (standard_pool(held[dtype](x), slots, blocks, bs) for x in (k, v))
        want = ops.attention(q, ref_k, ref_v, meta, scale, window, softcap, sink)
        assert torch.allclose(got, want, rtol=1e-4, atol=2e-5), (got - want).abs().max()
        if dtype == torch.uint8:
            exact = ops.attention(q, standard_pool(k, slots, blocks, bs), standard_pool(v, slots, blocks, bs), meta,
                                  scale, window, softcap, sink)
            assert (got - exact).abs().max() < Q8_ATTENTION_TOLERANCE * (2 if softcap else 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
@pytest.mark.parametrize("d", [64, 512])
def test_long_context_row_is_the_same_alone_batched_chunked_or_on_one_thread(dtype: torch.dtype, d: int) -> None:
    """A decode row over 700 keys alone (few tiles: one work item per chunk, merged after), beside 15 other
    sequences (one item per tile), on one thread, and the same rows from a prefill cut differently: bit-identical."""
    hq, hk, bs, blocks = 4, 2, 16, 120
    n = blocks * bs
    k, v = torch.randn(n, hk, d, generator=gen(11)), torch.randn(n, hk, d, generator=gen(12))
    k_cache, v_cache = write_pool(k, v, torch.arange(n), blocks, bs, dtype)
    q = torch.randn(40, hq, d, generator=gen(13))
    mine = list(range(44))

    def attend(q_rows, q_lens, seq_lens, tables, window=300):
        meta = metadata(q_lens, seq_lens, bs, tables)
        return cpu_native.attention(q_rows, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                    meta.block_tables, 0.125, torch.empty_like(q_rows), window, 0.0)

    alone = attend(q[:1], [1], [700], [mine])
    others = [list(range(44 + 4 * i, 48 + 4 * i)) for i in range(15)]
    batched = attend(torch.cat([q[1:16], q[:1]]), [1] * 16, [60] * 15 + [700], others + [mine])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = attend(q[:1], [1], [700], [mine])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched[15:], alone) and torch.equal(single, alone)
    # a prompt's last 40 rows at positions 660 .. 699, in one step and as 7 + 33
    whole = attend(q, [40], [700], [mine])
    cut = torch.cat([attend(q[:7], [7], [667], [mine]), attend(q[7:], [33], [700], [mine])])
    assert torch.equal(whole, cut)
    assert torch.equal(attend(q[39:], [1], [700], [mine]), whole[39:])
