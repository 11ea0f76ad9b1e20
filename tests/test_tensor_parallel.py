"""Tensor parallelism on the CPU (gloo, 2 ranks): the sharded model against the one-rank model, shape errors, and
the worker processes' lives (no process outlives its LLM or its parent; a dead worker fails calls, never hangs)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import psutil
import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.config import ModelConfig
from gpullama.engine.args import EngineConfig
from gpullama.quants import QTensor
from gpullama.sharding import ShardPlan
from tests.fixtures.quant_blocks import random_blocks

Q = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Wait until none of `pids` runs; return those still running at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def prompts(vocab: int) -> list[list[int]]:
    """Three prompts of different lengths (past the tiny models' sliding windows), two sharing a prefix."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(10, vocab, (30,), generator=gen).tolist()
    return [base[:24], base[:24] + base[24:29], base[5:12]]


def record_logits(llm: LLM) -> list[torch.Tensor]:
    """The logits of every step `llm`'s engine runs from now on (the runner's output, unchanged)."""
    steps: list[torch.Tensor] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(batch):
        out = execute(batch)
        steps.append(out.logits.detach().clone())
        return out

    runner.execute = spy
    return steps


# --------------------------------------------------------------------------------------------------------------
# logits: 2 ranks against 1
# --------------------------------------------------------------------------------------------------------------

CASES = [
    pytest.param("llama", "F32", False, id="llama-gqa-f32"),  # 4 q heads, 2 KV heads: one KV head per rank
    pytest.param("llama", "F32", True, id="llama-static-decode"),  # the decode path CUDA graphs capture
    pytest.param("qwen2", "Q4_0", False, id="qwen2-q4_0-bias"),  # quantized (Q8_0 embedding), q/k/v biases
    pytest.param("phi3", "F32", False, id="phi3-fused"),  # fused qkv and gate|up, partial rotary, LongRoPE, window
    pytest.param("gemma2", "Q8_0", False, id="gemma2-q8_0"),  # 1 KV head held by both ranks, post-norms, soft-caps
    pytest.param("gemma3", "Q4_0", False, id="gemma3-q4_0"),  # q/k norms, a second rope table for sliding layers
    # experts cut like an MLP: gpt-oss's MXFP4 experts with biases (down and o biases on rank 0), sinks per head
    pytest.param("gpt-oss", "MXFP4", False, id="gpt-oss-mxfp4"),
    pytest.param("qwen2moe", "Q8_0", True, id="qwen2moe-q8_0-static"),  # the shared expert and its gate too
]


@pytest.mark.parametrize(("arch", "weight_type", "static_decode"), CASES)
def test_two_ranks_match_one(tiny_model, arch: str, weight_type: str, static_decode: bool, monkeypatch) -> None:
    """Prefill logits of every position and the logits of every step of a batched greedy generation (prefill,
    then decode of three sequences at once) with 2 ranks equal those of 1 within float32 rounding, and so do the
    generated tokens and the embeddings; the worker is gone after shutdown."""
    if static_decode:  # decode steps on the padded static buffers, on both ranks (the worker gets this config)
        from_args = EngineConfig.from_args
        monkeypatch.setattr(EngineConfig, "from_args", classmethod(
            lambda cls, args, n: dataclasses.replace(from_args(args, n), static_decode=True)))
    path = str(tiny_model(arch, weight_type).path)
    one = LLM(path, device="cpu", dtype="float32")
    batch = prompts(one.config.vocab_size)
    one_steps = record_logits(one)
    one_out = one.generate(batch, GREEDY)
    with LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2) as two:
        pids = two.worker_pids
        assert len(pids) == 1 and alive(pids[0])
        if static_decode:
            assert two.engine.runner.decode_graphs is not None
        scale = one.logits(batch[1]).abs().max().item()
        torch.testing.assert_close(two.logits(batch[1]), one.logits(batch[1]), rtol=1e-4, atol=1e-5 * scale)
        two_steps = record_logits(two)
        two_out = two.generate(batch, GREEDY)
        two_embeddings = [torch.tensor(e.embedding) for e in two.embed(batch)]  # pooled on rank 0
    assert [o.token_ids for o in two_out] == [o.token_ids for o in one_out]
    for got, want in zip(two_embeddings, one.embed(batch)):
        torch.testing.assert_close(got, torch.tensor(want.embedding), rtol=1e-4, atol=1e-5)
    assert len(two_steps) == len(one_steps) and any(s.shape[0] == len(batch) for s in one_steps[1:])
    for a, b in zip(two_steps, one_steps):
        assert a.shape == b.shape == (a.shape[0], one.model.vocab_size)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)
    assert wait_gone(pids) == []


@pytest.mark.parametrize(("arch", "weight_type"), [("qwen2", "Q4_0"), ("qwen3moe", "Q8_0")])
def test_two_ranks_on_the_cpu_fast_path(tiny_model, monkeypatch, arch: str, weight_type: str) -> None:
    """dtype auto on a quantized file: every rank runs the CPU fast path (the workers are told to), and the sharded
    logits stay within the fast path's tolerance of the exact one-rank path, with its top tokens."""
    from gpullama.engine.tp_workers import TPWorkers
    from gpullama.kernels import cpu_native
    from gpullama.ops import CpuOps
    from tests.test_cpu_fast_path import assert_close_and_same_top1
    from tests.test_model_parity import token_ids

    if cpu_native.library() is None:
        pytest.skip(f"no CPU kernels: {cpu_native.build_error()}")
    specs = []
    start = TPWorkers.start.__func__
    monkeypatch.setattr(TPWorkers, "start", classmethod(lambda cls, spec, n, rdzv=None: specs.append(spec) or start(cls, spec, n, rdzv)))
    path = str(tiny_model(arch, weight_type).path)
    exact = LLM(path, device="cpu", dtype="float32")
    ids = token_ids(exact.config.vocab_size, n=40)
    with LLM(path, device="cpu", tensor_parallel_size=2) as two:
        assert isinstance(two.model.ops, CpuOps) and [spec.quantized_cpu for spec in specs] == [True]
        assert_close_and_same_top1(two.logits(ids), exact.logits(ids), f"{arch} {weight_type}, 2 ranks, fast path")


def test_a_dead_worker_fails_calls_and_shutdown_still_cleans_up(tiny_model) -> None:
    """Kill the worker: the next call raises at once naming the rank (no hang), and shutdown returns."""
    path = str(tiny_model("llama", "F32").path)
    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        (pid,) = llm.worker_pids
        assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
        os.kill(pid, signal.SIGKILL)
        assert wait_gone([pid]) == []
        deadline = time.monotonic() + 10
        while llm.engine.runner.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank 1" in llm.engine.runner.failure and "exited" in llm.engine.runner.failure
        out = llm.generate([[5, 6, 7]], GREEDY)[0]  # the engine ends the request with an error, not a hang
        assert out.finish_reason == "error" and "tensor parallelism is down" in out.error
    finally:
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 10


_PARENT = """
import sys, time
from gpullama import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
    print("ready", flush=True)
    time.sleep(600)
"""


def test_workers_die_with_a_killed_parent(tiny_model, tmp_path) -> None:
    """SIGKILL the process that holds a 2-rank LLM: every process it started ends within seconds."""
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    parent = subprocess.Popen([sys.executable, str(script), str(tiny_model("llama", "F32").path)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert parent.stdout.readline().strip() == "ready"
        children = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        assert children  # the worker (and multiprocessing's resource tracker)
        parent.kill()
        parent.wait()
        assert wait_gone(children) == []
    finally:
        parent.kill()


# --------------------------------------------------------------------------------------------------------------
# shapes that cannot be cut: one clear error at load, before any process starts
# --------------------------------------------------------------------------------------------------------------


def test_an_uneven_cut_is_refused_before_any_process_starts(tiny_model, default_model_path) -> None:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    # SmolLM2-135M: 9 attention heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the 9 attention heads .*"
                                         r"blk\.0\.attn_q\.weight"):
        LLM(str(default_model_path), device="cpu", tensor_parallel_size=2)
    # the tiny Q4_K model: o's 256 columns split at 128 would cut a 256-value super-block
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_output\.weight' at 128, which cuts its Q4_K blocks of 256"):
        LLM(str(tiny_model("llama", "Q4_K").path), device="cpu", tensor_parallel_size=2)
    assert {p.pid for p in me.children(recursive=True)} == before


def _config(**changes) -> ModelConfig:
    base = dict(architecture="llama", num_layers=1, hidden_size=64, intermediate_size=128, num_heads=4,
                num_kv_heads=2, head_dim=16, vocab_size=100, context_length=64, rope_base=10000.0, rms_eps=1e-5)
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize(("changes", "world", "message"), [
    (dict(num_heads=6, num_kv_heads=6), 4, r"does not divide the 6 attention heads"),
    (dict(num_heads=12, num_kv_heads=3), 2, r"the 3 KV heads .* do not divide one another"),
    (dict(num_heads=12, num_kv_heads=2), 3, r"the 2 KV heads .* do not divide one another"),
    (dict(intermediate_size=102), 4, r"does not divide the MLP's 102 rows .*blk\.0\.ffn_up\.weight"),
])
def test_shard_plan_errors(changes: dict, world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardPlan(_config(**changes), 0, world)


def test_shard_plan_cuts_whole_heads_and_blocks() -> None:
    """Each rank's part of every kind of tensor equals the matching slice of the dequantized whole (the reference:
    gguf-layout blocks dequantized by `QTensor.dequantize`)."""
    c = _config(num_heads=4, num_kv_heads=1, head_dim=32, hidden_size=64, intermediate_size=128, vocab_size=101)
    hidden, inter = 64, 128

    def weight(name: str, rows: int, cols: int, qtype=Q.Q8_0) -> QTensor:
        return QTensor(torch.from_numpy(random_blocks(qtype, rows, cols, 1)), qtype, (rows, cols), name)

    tensors = {
        "blk.0.attn_q.weight": weight("blk.0.attn_q.weight", 4 * 32, hidden),
        "blk.0.attn_k.weight": weight("blk.0.attn_k.weight", 32, hidden),
        "blk.0.attn_qkv.weight": weight("blk.0.attn_qkv.weight", 6 * 32, hidden),
        "blk.0.attn_output.weight": weight("blk.0.attn_output.weight", hidden, 4 * 32),
        "blk.0.ffn_up.weight": weight("blk.0.ffn_up.weight", 2 * inter, hidden, Q.Q4_0),  # fused gate|up
        "blk.0.ffn_down.weight": weight("blk.0.ffn_down.weight", hidden, inter),
        "token_embd.weight": weight("token_embd.weight", 101, hidden),
        "blk.0.attn_norm.weight": QTensor(torch.randn(hidden), Q.F32, (hidden,), "blk.0.attn_norm.weight"),
    }
    whole = {name: t.dequantize() for name, t in tensors.items()}
    plans = [ShardPlan(c, r, 2) for r in range(2)]
    plans[0].check(tensors)
    for r, plan in enumerate(plans):
        part = {name: plan.local(name, t).dequantize() for name, t in tensors.items()}
        q = slice(r * 64, r * 64 + 64)  # 2 q heads of 32 each
        torch.testing.assert_close(part["blk.0.attn_q.weight"], whole["blk.0.attn_q.weight"][q], rtol=0, atol=0)
        # one KV head for 4 q heads: both ranks hold it
        torch.testing.assert_close(part["blk.0.attn_k.weight"], whole["blk.0.attn_k.weight"], rtol=0, atol=0)
        qkv = whole["blk.0.attn_qkv.weight"]
        torch.testing.assert_close(part["blk.0.attn_qkv.weight"], torch.cat([qkv[q], qkv[128:160], qkv[160:192]]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(part["blk.0.attn_output.weight"], whole["blk.0.attn_output.weight"][:, q],
                                   rtol=0, atol=0)
        up = whole["blk.0.ffn_up.weight"]
        i = slice(r * 64, r * 64 + 64)
        torch.testing.assert_close(part["blk.0.ffn_up.weight"], torch.cat([up[:inter][i], up[inter:][i]]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(part["blk.0.ffn_down.weight"], whole["blk.0.ffn_down.weight"][:, i], rtol=0, atol=0)
        assert part["blk.0.attn_norm.weight"].equal(whole["blk.0.attn_norm.weight"])
        vocab = slice(r * 51, min(r * 51 + 51, 101))  # 101 tokens: 51 per rank, the last padded with a zero row
        rows = part["token_embd.weight"]
        assert rows.shape == (51, hidden)
        torch.testing.assert_close(rows[: vocab.stop - vocab.start], whole["token_embd.weight"][vocab], rtol=0, atol=0)
        assert not rows[vocab.stop - vocab.start :].any()
    # a Q4_K ffn_down of 256 columns split at 128 would cut its 256-value super-blocks
    down = {"blk.0.ffn_down.weight": weight("blk.0.ffn_down.weight", hidden, 256, Q.Q4_K)}
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' at 128, which cuts its Q4_K blocks of 256"):
        ShardPlan(dataclasses.replace(c, intermediate_size=256), 0, 2).check(down)


def test_shard_plan_cuts_every_expert_like_an_mlp() -> None:
    """Stacked experts: each rank holds its rows of every expert's gate and up (fused gate|up: both halves), the
    matching columns of down and of the biases; down's and the output's biases on rank 0 only; routers whole."""
    e, hidden, inter = 4, 64, 64
    c = _config(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=hidden, num_experts=e, num_experts_used=2,
                expert_intermediate_size=inter)

    def experts(name: str, rows: int, cols: int, qtype=Q.Q8_0) -> QTensor:
        raw = torch.from_numpy(random_blocks(qtype, e * rows, cols, 2)).view(e, rows, -1)
        return QTensor(raw, qtype, (e, rows, cols), name)

    def floats(name: str, *shape: int) -> QTensor:
        return QTensor(torch.randn(*shape), Q.F32, shape, name)

    tensors = {t.name: t for t in (
        experts("blk.0.ffn_gate_exps.weight", inter, hidden), experts("blk.0.ffn_gate_up_exps.weight", 2 * inter,
                                                                      hidden, Q.MXFP4),
        experts("blk.0.ffn_down_exps.weight", hidden, inter), floats("blk.0.ffn_gate_exps.bias", e, inter),
        floats("blk.0.ffn_gate_up_exps.bias", e, 2 * inter), floats("blk.0.ffn_down_exps.bias", e, hidden),
        floats("blk.0.attn_output.bias", hidden), floats("blk.0.ffn_gate_inp.weight", e, hidden),
        floats("blk.0.attn_sinks.weight", 4))}
    whole = {name: t.dequantize() for name, t in tensors.items()}
    for r in range(2):
        plan = ShardPlan(c, r, 2)
        plan.check(tensors)
        part = {name: plan.local(name, t).dequantize() for name, t in tensors.items()}
        i = slice(r * 32, r * 32 + 32)
        assert part["blk.0.ffn_gate_exps.weight"].equal(whole["blk.0.ffn_gate_exps.weight"][:, i])
        fused = whole["blk.0.ffn_gate_up_exps.weight"]
        assert part["blk.0.ffn_gate_up_exps.weight"].equal(torch.cat([fused[:, :inter][:, i], fused[:, inter:][:, i]],
                                                                      dim=1))
        assert part["blk.0.ffn_down_exps.weight"].equal(whole["blk.0.ffn_down_exps.weight"][..., i])
        assert part["blk.0.ffn_gate_exps.bias"].equal(whole["blk.0.ffn_gate_exps.bias"][:, i])
        bias = whole["blk.0.ffn_gate_up_exps.bias"]
        assert part["blk.0.ffn_gate_up_exps.bias"].equal(torch.cat([bias[:, :inter][:, i], bias[:, inter:][:, i]], -1))
        for once in ("blk.0.ffn_down_exps.bias", "blk.0.attn_output.bias"):
            assert part[once].equal(whole[once] if r == 0 else torch.zeros_like(whole[once]))
        assert part["blk.0.ffn_gate_inp.weight"].equal(whole["blk.0.ffn_gate_inp.weight"])
        assert part["blk.0.attn_sinks.weight"].equal(whole["blk.0.attn_sinks.weight"][2 * r : 2 * r + 2])
    with pytest.raises(ValueError, match=r"does not divide each expert's 50 rows .*expert_feed_forward_length"):
        ShardPlan(dataclasses.replace(c, expert_intermediate_size=50), 0, 4)


def test_tensor_parallel_size_is_an_engine_argument() -> None:
    from gpullama.engine.args import EngineArgs

    assert EngineArgs().tensor_parallel_size == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            EngineArgs(tensor_parallel_size=bad)
