"""The C kernels of the CPU fast path (`gpullama.kernels.cpu_native`) against torch references (`TorchOps`, the
exact float32 path), and each row's independence from the batch around it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpullama.kernels import cpu_native
from gpullama.ops import BatchMetadata, TorchOps, rope_cos_sin

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")

REPO = Path(__file__).resolve().parents[2]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_with_and_without_the_residual() -> None:
    x, res = (torch.randn(5, 200, generator=gen(i)) for i in range(2))
    w = torch.randn(200, generator=gen(2))
    for residual in (None, res):
        h = x.clone()
        out = cpu_native.rms_norm(h, residual, w, 1e-5, torch.empty_like(h))
        want, want_h = TorchOps(torch.device("cpu")).rms_norm(x, w, 1e-5, residual)
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(h, want_h)  # the sum is exact either way


def test_silu_mul() -> None:
    gate_up = torch.randn(3, 2 * 72, generator=gen()) * 4
    out = cpu_native.silu_mul(gate_up, torch.empty(3, 72))
    assert torch.allclose(out, F.silu(gate_up[:, :72]) * gate_up[:, 72:], rtol=1e-5, atol=1e-6)


def test_argmax_takes_the_first_of_equal_largest_values() -> None:
    x = torch.randn(4, 1000, generator=gen())
    x[1, 500] = x[1, 20] = 9.0  # a tie: the first index wins, as torch.argmax
    x[2, 999] = 9.0  # the tail past the last whole vector
    assert torch.equal(cpu_native.argmax(x), x.argmax(-1))
    assert cpu_native.argmax(x)[1] == 20


def metadata(q_lens: list[int], seq_lens: list[int], block_size: int, blocks: list[list[int]]) -> BatchMetadata:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    width = max(len(b) for b in blocks)
    positions = [p for n, s in zip(q_lens, seq_lens) for p in range(s - n, s)]
    slots = [b[p // block_size] * block_size + p % block_size
             for n, s, b in zip(q_lens, seq_lens, blocks) for p in range(s - n, s)]
    return BatchMetadata(
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]]), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )


def transposed(k_cache: torch.Tensor) -> torch.Tensor:
    """The pool's k as the kernels keep it: each block [Hk, D, block_size], in a tensor of the pool's shape."""
    return k_cache.permute(0, 2, 3, 1).contiguous().view(k_cache.shape)


def attend(q, k_cache, v_cache, meta, scale):
    return cpu_native.attention(q, transposed(k_cache), v_cache, meta.query_start_loc, meta.seq_lens,
                                meta.block_tables, scale, torch.empty_like(q))


@pytest.mark.parametrize(("head_dim", "block_size", "hq"), [(64, 16, 6), (128, 32, 6), (64, 16, 40)])
def test_attention_matches_torch_over_a_ragged_batch(head_dim: int, block_size: int, hq: int) -> None:
    """Prefill chunks, a whole prompt and decode rows in one batch, GQA (3 or 20 query heads a kv head), keys spread
    over non-contiguous pool blocks."""
    hk = 2
    k_cache = torch.randn(12, block_size, hk, head_dim, generator=gen(1))
    v_cache = torch.randn(12, block_size, hk, head_dim, generator=gen(2))
    meta = metadata([5, 40, 1, 1], [37, 40, 1, 20], block_size, [[7, 2, 9], [3, 0, 11], [5], [4, 10]])
    q = torch.randn(47, hq, head_dim, generator=gen(3))
    want = TorchOps(torch.device("cpu")).attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    assert torch.allclose(attend(q, k_cache, v_cache, meta, head_dim**-0.5), want, rtol=1e-4, atol=1e-5)


def test_attention_row_is_the_same_alone_batched_or_chunked() -> None:
    """A sequence's rows come out bit-identical whatever shares the batch and however its prompt is cut."""
    block_size, hq, hk, d = 16, 4, 2, 64
    k_cache = torch.randn(8, block_size, hk, d, generator=gen(4))
    v_cache = torch.randn(8, block_size, hk, d, generator=gen(5))
    q = torch.randn(30, hq, d, generator=gen(6))
    alone = attend(q, k_cache, v_cache, metadata([30], [30], block_size, [[1, 6]]), 0.125)
    first = attend(q[:11], k_cache, v_cache, metadata([11], [11], block_size, [[1, 6]]), 0.125)
    others = torch.randn(9, hq, d, generator=gen(7))
    batched = attend(torch.cat([others, q[11:]]), k_cache, v_cache,
                     metadata([9, 19], [40, 30], block_size, [[2, 3, 4], [1, 6]]), 0.125)
    assert torch.equal(first, alone[:11])
    assert torch.equal(batched[9:], alone[11:])


def test_rope_and_cache_matches_torch() -> None:
    """Rotation in place on row-strided views of a fused qkv output, k and v written to their pool rows."""
    hq, hk, d, t = 4, 2, 64, 6
    cos_sin = rope_cos_sin(d, 64, 10000.0)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen(8))
    q, k, v = (qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d),
               qkv[:, (hq + hk) * d:].view(t, hk, d))
    meta = metadata([t], [t + 3], 16, [[2]])
    caches = [torch.zeros(4, 16, hk, d) for _ in range(4)]
    want_q, want_k = TorchOps(torch.device("cpu")).rope_and_cache(q.clone(), k.clone(), v, cos_sin, caches[0],
                                                                 caches[1], meta)
    cpu_native.rope_and_cache(q, k, v, cos_sin, meta.positions, meta.slot_mapping, caches[2], caches[3])
    assert torch.allclose(q, want_q, atol=1e-6) and torch.allclose(k, want_k, atol=1e-6)
    assert torch.allclose(caches[2], transposed(caches[0]), atol=1e-6) and torch.equal(caches[3], caches[1])


def test_without_a_compiler_library_is_none_and_says_why(tmp_path: Path) -> None:
    """No C compiler: `library()` gives None and `build_error()` the reason; `dtype="auto"` then loads the exact
    float32 path instead of failing."""
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), GPULLAMA_KERNEL_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO))
    code = ("from gpullama.kernels import cpu_native; from gpullama.ops import select_ops; import torch;"
            "print(cpu_native.library(), '|', cpu_native.build_error(), '|',"
            " select_ops(torch.device('cpu'), torch.float32, quantized_cpu=True).name)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lib, error, ops = (s.strip() for s in out.stdout.split("|"))
    assert lib == "None" and "no-such-cc" in error and ops == "torch"
