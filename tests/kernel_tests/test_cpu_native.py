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


def test_gelu_tanh_mul() -> None:
    gate_up = torch.randn(3, 2 * 72, generator=gen()) * 4
    gate_up[0, :4] = torch.tensor([-200.0, -30.0, 30.0, 0.0])  # far out: no overflow, no NaN
    out = cpu_native.gelu_tanh_mul(gate_up, torch.empty(3, 72))
    want = F.gelu(gate_up[:, :72], approximate="tanh") * gate_up[:, 72:]
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("scale", "cap"), [(0.5, 0.0), (1.0, 30.0), (0.25, 5.0)])
def test_soft_cap_in_place_on_a_column_slice(scale: float, cap: float) -> None:
    """Final logits are a column slice of the padded matmul output: only the slice changes."""
    wide = torch.randn(3, 112, generator=gen()) * 40
    copy = wide.clone()
    want = TorchOps(torch.device("cpu")).soft_cap(wide[:, :100], cap, scale)
    cpu_native.soft_cap(copy[:, :100], scale, cap)
    assert torch.allclose(copy[:, :100], want, rtol=1e-5, atol=1e-5 * max(cap, 1.0))
    assert torch.equal(copy[:, 100:], wide[:, 100:])


def test_argmax_takes_the_first_of_equal_largest_values() -> None:
    x = torch.randn(4, 1000, generator=gen())
    x[1, 500] = x[1, 20] = 9.0  # a tie: the first index wins, as torch.argmax
    x[2, 999] = 9.0  # the tail past the last whole vector
    assert torch.equal(cpu_native.argmax(x), x.argmax(-1))
    assert cpu_native.argmax(x)[1] == 20


@pytest.mark.parametrize("n", [0, 1, 63, 64, 4095, 64 * 64 + 17, 100_003])
@pytest.mark.parametrize("threads", [1, 2])
def test_read_sum_reads_every_value_once(n: int, threads: int) -> None:
    """The streaming read behind `gpullama bench`'s read bandwidth sums every value exactly once: small integers, so
    float32 sums are exact whatever the order (torch.sum in float64 the reference)."""
    x = torch.randint(-8, 9, (n,), generator=gen()).float()
    assert cpu_native.read_sum(x, threads) == float(x.double().sum())


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_advice_marks_the_whole_2mib_stretches_and_keeps_the_contents() -> None:
    """`advise_huge_pages` (the read bandwidth's buffer): the kernel's record of the mapping gains MADV_HUGEPAGE's
    flag (``hg`` in /proc/self/smaps) over the tensor's whole 2 MiB stretches; a tensor with none is left alone; the
    values are untouched."""
    assert not cpu_native.advise_huge_pages(torch.ones(1000))
    if sys.platform != "linux":
        assert not cpu_native.advise_huge_pages(torch.ones(3 << 20))
        return
    x = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: its own mapping, at least 4 whole 2 MiB stretches
    assert "hg" not in _vm_flags(x.data_ptr() + (6 << 20))
    if not cpu_native.advise_huge_pages(x):
        pytest.skip("this kernel refuses MADV_HUGEPAGE (built without transparent huge pages)")
    assert "hg" in _vm_flags(x.data_ptr() + (6 << 20))
    assert torch.equal(x, torch.arange(3 << 20, dtype=torch.float32))


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


def attend(q, k_cache, v_cache, meta, scale, window=0, softcap=0.0):
    return cpu_native.attention(q, transposed(k_cache), v_cache, meta.query_start_loc, meta.seq_lens,
                                meta.block_tables, scale, torch.empty_like(q), window, softcap)


@pytest.mark.parametrize(("head_dim", "block_size", "hq", "window", "softcap"), [
    (64, 16, 6, 0, 0.0), (128, 32, 6, 0, 0.0), (64, 16, 40, 0, 0.0),
    (64, 16, 6, 7, 0.0), (256, 16, 2, 20, 0.0), (64, 16, 6, 0, 2.0), (64, 16, 40, 33, 1.5),
    (512, 16, 6, 7, 0.0), (320, 32, 2, 0, 2.0),  # wider than the kernel's 256-dim pieces: Gemma 4's full layers (512)
])
def test_attention_matches_torch_over_a_ragged_batch(head_dim: int, block_size: int, hq: int, window: int,
                                                     softcap: float) -> None:
    """Prefill chunks, a whole prompt and decode rows in one batch, GQA (3 or 20 query heads a kv head), keys spread
    over non-contiguous pool blocks; sliding windows (shorter and longer than a tile of keys) and soft caps."""
    hk = 2 if hq > 2 else 1
    k_cache = torch.randn(12, block_size, hk, head_dim, generator=gen(1))
    v_cache = torch.randn(12, block_size, hk, head_dim, generator=gen(2))
    q = torch.randn(47, hq, head_dim, generator=gen(3)) * (3.0 if softcap else 1.0)  # scores beyond the cap
    ops = TorchOps(torch.device("cpu"))
    for meta in (metadata([5, 40, 1, 1], [37, 40, 1, 20], block_size, [[7, 2, 9], [3, 0, 11], [5], [4, 10]]),
                 metadata([1, 1, 1], [37, 1, 20], block_size, [[7, 2, 9], [5], [4, 10]])):  # decode only
        t = len(meta.positions)
        got = attend(q[:t], k_cache, v_cache, meta, head_dim**-0.5, window, softcap)
        want = ops.attention(q[:t], k_cache, v_cache, meta, head_dim**-0.5, window, softcap)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [0, 13])
def test_attention_row_is_the_same_alone_batched_or_chunked(window: int) -> None:
    """A sequence's rows come out bit-identical whatever shares the batch and however its prompt is cut."""
    block_size, hq, hk, d = 16, 4, 2, 64
    k_cache = torch.randn(8, block_size, hk, d, generator=gen(4))
    v_cache = torch.randn(8, block_size, hk, d, generator=gen(5))
    q = torch.randn(30, hq, d, generator=gen(6))
    alone = attend(q, k_cache, v_cache, metadata([30], [30], block_size, [[1, 6]]), 0.125, window)
    first = attend(q[:11], k_cache, v_cache, metadata([11], [11], block_size, [[1, 6]]), 0.125, window)
    others = torch.randn(9, hq, d, generator=gen(7))
    batched = attend(torch.cat([others, q[11:]]), k_cache, v_cache,
                     metadata([9, 19], [40, 30], block_size, [[2, 3, 4], [1, 6]]), 0.125, window)
    assert torch.equal(first, alone[:11])
    assert torch.equal(batched[9:], alone[11:])


@pytest.mark.parametrize(("rotary_dim", "d"), [(64, 64), (32, 64), (8, 64), (512, 512), (128, 512)])
def test_rope_and_cache_matches_torch(rotary_dim: int, d: int) -> None:
    """Rotation in place on row-strided views of a fused qkv output (all of each head, or its first dims: partial
    rotary), k and v written to their pool rows."""
    hq, hk, t = 4, 2, 6
    cos_sin = rope_cos_sin(rotary_dim, 64, 10000.0)
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


def run_python(code: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([5, 1, 9], [5, 1, 2]), ([7, 1, 3], [1, 1, 1])],
                         ids=["prefill", "decode"])
def test_short_conv_matches_torch_and_updates_the_states(seq_lens, q_lens) -> None:
    """LFM2's short convolution (kernel 3, 40 channels: two full 16-lane groups and a partial one) over a ragged
    batch: chunks after earlier ones (their inputs from the state slot), a sequence starting at position 0 (zeros,
    whatever its slot holds), decode rows; the outputs and the updated slots equal TorchOps' (the same sums in the
    same order)."""
    h, lk, num_slots = 40, 3, 5
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = BatchMetadata(
        positions=torch.tensor([p for s, n in zip(seq_lens, q_lens) for p in range(s - n, s)]),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.zeros(3, 1, dtype=torch.int32),
        logits_indices=torch.tensor(starts[1:]) - 1, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, state_slots=torch.tensor([3, 0, 4]),
    )
    x = torch.randn(starts[-1], h, generator=gen(1))
    kernel = torch.randn(lk, h, generator=gen(2))
    states = torch.randn(num_slots, lk - 1, h, generator=gen(3))
    want_states, got_states = states.clone(), states.clone()
    want = TorchOps(torch.device("cpu")).short_conv(x, kernel, want_states, meta)
    got = cpu_native.short_conv(x, kernel, got_states, meta.state_slots, meta.positions, meta.query_start_loc,
                                torch.empty_like(x))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got_states, want_states, rtol=0, atol=0)
    assert torch.equal(got_states[[1, 2]], states[[1, 2]])  # slots no sequence holds are untouched


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([70, 1, 9], [70, 1, 2]), ([7, 1, 3], [1, 1, 1])],
                         ids=["prefill", "decode"])
def test_gated_delta_rule_matches_torch_and_updates_the_states(seq_lens, q_lens) -> None:
    """Qwen3.5's gated delta rule (2 key heads for 4 value heads, key dim 16, value dim 24: a full 16-column group
    and a partial one) over a ragged batch: a 70-row chunk (torch: two chunks of the chunked form; C: the recurrence),
    a sequence at position 0 (zeros, whatever its slot holds), chunks after earlier rows, decode rows; q, k, v are
    strided views of one row, as the decoder passes them. The outputs and the updated slots equal TorchOps'."""
    hk, hv, dk, dv, num_slots = 2, 4, 16, 24, 5
    meta = make_meta(seq_lens, q_lens, slots=[3, 0, 4])
    t = meta.positions.shape[0]
    qkv = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen(1))
    q, k, v = qkv[:, : hk * dk].view(t, hk, dk), qkv[:, hk * dk : 2 * hk * dk].view(t, hk, dk), \
        qkv[:, 2 * hk * dk :].view(t, hv, dv)
    decay = -F.softplus(torch.randn(t, hv, generator=gen(2)))
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen(3)))
    states = torch.randn(num_slots, hv, dk, dv, generator=gen(4)) * 0.3
    want_states, got_states = states.clone(), states.clone()
    want = TorchOps(torch.device("cpu")).gated_delta_rule(q, k, v, decay, beta, want_states, meta)
    got = cpu_native.gated_delta_rule(q, k, v, decay, beta, got_states, meta.state_slots, meta.positions,
                                      meta.query_start_loc, torch.empty(t, hv, dv))
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert (got_states - want_states).abs().max() < 1e-5 * want_states.abs().max()
    assert torch.equal(got_states[[1, 2]], states[[1, 2]])  # slots no sequence holds are untouched


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([70, 1, 9], [70, 1, 2]), ([7, 1, 3], [1, 1, 1])],
                         ids=["prefill", "decode"])
def test_ssm_scan_matches_torch_and_updates_the_states(seq_lens, q_lens) -> None:
    """Mamba2's selective scan (4 heads in 2 groups, head dim 24: a full 16-column group and a partial one, state
    size 16) over a ragged batch: a 70-row chunk (torch: two chunks of the chunked form; C: the recurrence), a
    sequence at position 0 (zeros, whatever its slot holds), chunks after earlier rows, decode rows; x, B and C are
    strided views of one row, as the decoder passes them. The outputs and the updated slots equal TorchOps'."""
    heads, groups, p, n, num_slots = 4, 2, 24, 16, 5
    meta = make_meta(seq_lens, q_lens, slots=[3, 0, 4])
    t = meta.positions.shape[0]
    xbc = torch.randn(t, heads * p + 2 * groups * n, generator=gen(1))
    x, b, c = xbc[:, : heads * p].view(t, heads, p), xbc[:, heads * p : heads * p + groups * n].view(t, groups, n), \
        xbc[:, heads * p + groups * n :].view(t, groups, n)
    dt = F.softplus(torch.randn(t, heads, generator=gen(2)))
    a = -torch.exp(torch.randn(heads, generator=gen(3)))
    states = torch.randn(num_slots, heads, n, p, generator=gen(4)) * 0.3
    want_states, got_states = states.clone(), states.clone()
    want = TorchOps(torch.device("cpu")).ssm_scan(x, dt, a, b, c, want_states, meta)
    got = cpu_native.ssm_scan(x, dt, a, b, c, got_states, meta.state_slots, meta.positions, meta.query_start_loc,
                              torch.empty(t, heads, p))
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert (got_states - want_states).abs().max() < 1e-5 * want_states.abs().max()
    assert torch.equal(got_states[[1, 2]], states[[1, 2]])  # slots no sequence holds are untouched


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([70, 1, 9], [70, 1, 2]), ([7, 1, 3], [1, 1, 1])],
                         ids=["prefill", "decode"])
def test_mamba2_mixer_matches_torch_and_updates_the_states(seq_lens, q_lens) -> None:
    """Mamba2's whole mixer in one C call (4 heads of 24 in 2 groups, state 16, kernel 4) against TorchOps' own
    composition of the same steps (convolution plus bias and SiLU, softplus of dt plus its bias with some inputs past
    torch's threshold of 20, the scan, the D skip, the SiLU gate, an RMSNorm a group): outputs and both kinds of
    state, over a ragged batch as the scan's test runs it."""
    heads, groups, p, n, lk, num_slots = 4, 2, 24, 16, 4, 5
    inner, channels = heads * p, heads * p + 2 * groups * n
    meta = make_meta(seq_lens, q_lens, slots=[3, 0, 4])
    t = meta.positions.shape[0]
    zxbcdt = torch.randn(t, inner + channels + heads, generator=gen(1))
    zxbcdt[::5, -1] = 25.0  # softplus' linear branch
    kernel, conv_bias = torch.randn(lk, channels, generator=gen(2)), torch.randn(channels, generator=gen(3))
    dt_bias, d = torch.randn(heads, generator=gen(4)), torch.randn(heads, generator=gen(5))
    a = -torch.exp(torch.randn(heads, generator=gen(6)))
    norm = torch.rand(groups, inner // groups, generator=gen(7)) + 0.5
    conv_states = torch.randn(num_slots, lk - 1, channels, generator=gen(8))
    ssm_states = torch.randn(num_slots, heads, n, p, generator=gen(9)) * 0.3
    args = ((inner, heads, groups, n), kernel, conv_bias, dt_bias, a, d, norm, 1e-5)
    want_conv, want_ssm = conv_states.clone(), ssm_states.clone()
    want = TorchOps(torch.device("cpu")).mamba2(zxbcdt, *args, want_conv, want_ssm, meta)
    got_conv, got_ssm = conv_states.clone(), ssm_states.clone()
    got = cpu_native.mamba2(zxbcdt, inner, heads, groups, n, kernel, conv_bias, dt_bias, a, d, norm.flatten(), 1e-5,
                            got_conv, got_ssm, meta.state_slots, meta.positions, meta.query_start_loc,
                            torch.empty(t, inner))
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert torch.equal(got_conv, want_conv)
    assert (got_ssm - want_ssm).abs().max() < 1e-5 * want_ssm.abs().max()
    assert torch.equal(got_ssm[[1, 2]], ssm_states[[1, 2]])  # slots no sequence holds are untouched


def make_meta(seq_lens: list[int], q_lens: list[int], slots: list[int]) -> BatchMetadata:
    """Metadata of sequences whose last `q_lens[i]` of `seq_lens[i]` rows are new, in state slots `slots` (no KV
    pool: for the recurrent layers' scans)."""
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return BatchMetadata(
        positions=torch.tensor([p for s, n in zip(seq_lens, q_lens) for p in range(s - n, s)]),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.int32),
        logits_indices=torch.tensor(starts[1:]) - 1, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, state_slots=torch.tensor(slots),
    )


def test_without_a_compiler_auto_loads_the_exact_path_and_says_why(tmp_path: Path, tiny_model) -> None:
    """No C compiler (CC names a missing binary, an empty kernel cache): `library()` gives None, `build_error()`
    the reason, a warning says the torch path is used, and ``dtype="auto"`` on a quantized file loads the exact
    float32 path (`TorchOps`) and generates instead of failing."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING, stream=sys.stderr)\n"
        "from gpullama import LLM, SamplingParams; from gpullama.kernels import cpu_native\n"
        f"llm = LLM({str(tiny_model('llama', 'Q4_0').path)!r}, device='cpu')\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]\n"
        "print(cpu_native.library(), '|', cpu_native.build_error(), '|', type(llm.model.ops).__name__, '|',"
        " llm.dtype, '|', len(out.token_ids))\n"
    )
    proc = run_python(code, {"CC": str(tmp_path / "no-such-cc"), "GPULLAMA_KERNEL_CACHE": str(tmp_path / "cache")})
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    lib, error, ops, dtype, n = (part.strip() for part in stdout.split("|"))
    assert lib == "None" and "no-such-cc" in error
    assert (ops, dtype, n) == ("TorchOps", "torch.float32", "3")
    assert "CPU kernels unavailable, using the torch path" in stderr and "no-such-cc" in stderr


def test_processes_compiling_at_once_share_one_library(tmp_path: Path) -> None:
    """Two processes building into the same empty cache at once (tensor-parallel ranks, a server beside a test
    run) both load working kernels; the cache ends with one library and no half-written files."""
    cache = tmp_path / "cache"
    # built at -O0 (3 s, against 30 s at -O3): what is checked is the cache's locking, not the code the flags make
    code = ("from gpullama.kernels import cpu_native; import torch\n"
            "cpu_native.FLAG_SETS = (('-O0', '-fopenmp'), ('-O0',))\n"
            "assert cpu_native.library() is not None, cpu_native.build_error()\n"
            "x = torch.randn(3, 40)\n"
            "out = cpu_native.silu_mul(x, torch.empty(3, 20))\n"
            "assert torch.allclose(out, torch.nn.functional.silu(x[:, :20]) * x[:, 20:], atol=1e-6)\n"
            "print(cpu_native.isa())\n")
    procs = [run_python(code, {"GPULLAMA_KERNEL_CACHE": str(cache)}) for _ in range(2)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        assert stdout.strip() == "generic"  # the -O0 build: no -march, no vector branch
    assert sorted(p.suffix for p in cache.iterdir()) == [".so", ".warnings"]  # the compiler's output beside it


def _avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


@pytest.mark.skipif(not _avx2(), reason="no AVX2 on this CPU")
def test_vector_matmuls_equal_plain_c_bit_for_bit(tmp_path: Path) -> None:
    """The AVX2 dot products (vpmaddubsw for 4-bit values, vpmaddwd for 5-, 6- and 8-bit ones, their bit planes
    spread by vpshufb) and this CPU's own (the library the suite loads: -march=native, AVX512-VNNI where there is
    one) give the plain C path's exact integer sums: the same outputs, bit for bit, for every weight format, with
    16-bit and 8-bit activations."""
    import ctypes

    import gguf

    from gpullama.ops.cpu_weights import CpuWeight
    from gpullama.quants import QTensor
    from tests.fixtures.quant_blocks import random_blocks

    Q = gguf.GGMLQuantizationType
    libs = []
    # the plain C reference at -O0 (3 s to build, against 50 s at -O2: its outputs are integer sums and the same
    # float epilogue at any level); the builds run at once, one a core
    builds = [["-O2", "-mavx2", "-mfma", "-mf16c"], ["-O0"]]
    targets = [tmp_path / f"lib{i}.so" for i in range(len(builds))]
    compilers = [subprocess.Popen([os.environ.get("CC", "cc"), *flags, "-shared", "-fPIC", "-std=gnu11",
                                   str(cpu_native.SOURCE), "-o", str(out), "-lm"], stderr=subprocess.PIPE)
                 for flags, out in zip(builds, targets)]
    for compiler in compilers:
        _, err = compiler.communicate(timeout=600)
        assert compiler.returncode == 0, err.decode()
    for out in targets:
        lib = ctypes.CDLL(str(out))
        lib.gl_matmul.argtypes, lib.gl_matmul.restype = cpu_native._SIGNATURES["gl_matmul"], ctypes.c_int
        lib.gl_isa.restype = ctypes.c_char_p
        libs.append(lib)
    native = cpu_native.library()
    if native is not None:
        libs.append(native)
    assert [lib.gl_isa() for lib in libs[:2]] == [b"avx2", b"generic"]
    x = torch.randn(11, 512, generator=gen(5)) * 3
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q8_0, Q.Q5_K, Q.Q6_K, Q.MXFP4):
        w = CpuWeight.from_qtensor(QTensor(torch.from_numpy(random_blocks(qtype, 40, 512, 1)), qtype, (40, 512)))
        for bits in (16, 8):  # 8-bit activations: the vector paths skip the hi products, C adds them (zeros)
            outs = []
            for lib in libs:
                out = torch.empty(11, 48)
                assert lib.gl_matmul(w.fmt, x.data_ptr(), 11, 512, 512, w.blocks.data_ptr(), 48, out.data_ptr(), 48,
                                     bits, 1) == 0
                outs.append(out)
            assert all(torch.equal(out, outs[1]) for out in outs), (qtype.name, bits)
