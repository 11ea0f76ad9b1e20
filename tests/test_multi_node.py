"""Multi-node tensor parallelism on this machine: two "nodes", each a process tree started by its own command, meet
over loopback at node 0's store (vLLM's --nnodes/--node-rank/--master-addr/--master-port). Node 1 is
``gpullama-serve --headless``; node 0 is an `LLM` (for its logits) or ``gpullama-serve``. Their logits equal one
rank's; a node that never joins, or joins with other settings, fails the load naming it; a node that dies turns
/health into 503."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.engine.args import EngineArgs
from gpullama.engine.tp_workers import Rendezvous
from tests.server.conftest import free_port, start_server, stop_server
from tests.server.helpers import API_KEY
from tests.test_tensor_parallel import GREEDY, prompts, record_logits, wait_gone

REPO = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
# Ceilings on waiting for another process (node 1 joining or leaving, torchrun's ranks starting), sized for a busy
# machine; each wait ends as soon as its condition holds.
JOIN_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 120


def start_headless(model: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    """Node 1 of 2: ``gpullama-serve --headless`` (through ``python -m gpullama.server``) in its own session."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "gpullama.server", "--headless", "--model", str(model), "--device", "cpu",
               "--dtype", "float32", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)


def node0(path: str, port: int, **kwargs) -> LLM:
    return LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2, nnodes=2, node_rank=0,
               master_addr="127.0.0.1", master_port=port, **kwargs)


def test_two_nodes_match_one_rank_and_node_1_leaves_with_node_0(tiny_model, tmp_path: Path) -> None:
    """Prefill logits and every step's logits of a batched greedy generation across two nodes equal one rank's;
    when node 0 shuts down, node 1's command exits with status 0."""
    path = str(tiny_model("llama", "F32").path)
    one = LLM(path, device="cpu", dtype="float32")
    batch = prompts(one.config.vocab_size)
    one_steps = record_logits(one)
    one_out = one.generate(batch, GREEDY)
    port = free_port()
    node1 = start_headless(Path(path), port, tmp_path / "node1.log")
    try:
        with node0(path, port, distributed_timeout_seconds=JOIN_TIMEOUT_S) as two:
            assert two.worker_pids == []  # one rank per node: node 0's rank is this process
            scale = one.logits(batch[1]).abs().max().item()
            torch.testing.assert_close(two.logits(batch[1]), one.logits(batch[1]), rtol=1e-4, atol=1e-5 * scale)
            two_steps = record_logits(two)
            two_out = two.generate(batch, GREEDY)
        assert node1.wait(timeout=EXIT_TIMEOUT_S) == 0, (tmp_path / "node1.log").read_text()
    finally:
        node1.kill()
    assert [o.token_ids for o in two_out] == [o.token_ids for o in one_out]
    assert len(two_steps) == len(one_steps)
    for a, b in zip(two_steps, one_steps):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)
    assert "node 0 stopped the group" in (tmp_path / "node1.log").read_text()


def test_a_node_that_never_joins_is_named(tiny_model) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"node 1 \(rank 1\) did not join the group at 127\.0\.0\.1:\d+ within 3s"):
        node0(str(tiny_model("llama", "F32").path), free_port(), distributed_timeout_seconds=3)
    assert time.monotonic() - started < 30


def test_a_node_with_other_settings_is_refused(tiny_model, tmp_path: Path) -> None:
    """Node 1 given another context length: both ends fail at once, saying which setting differs."""
    path = tiny_model("llama", "F32").path
    port = free_port()
    node1 = start_headless(path, port, tmp_path / "node1.log", "--max-model-len", "64")
    try:
        with pytest.raises(RuntimeError, match=r"node 1 \(rank 1\) failed: .*max_model_len 64 here, 256 on node 0"):
            node0(str(path), port, distributed_timeout_seconds=JOIN_TIMEOUT_S)
        assert node1.wait(timeout=EXIT_TIMEOUT_S) == 1
    finally:
        node1.kill()
    assert "gpullama-serve: error: tensor parallel, node 1: the settings differ" in (tmp_path / "node1.log").read_text()


def test_a_dead_node_makes_the_server_unhealthy(tiny_model, tmp_path: Path) -> None:
    """``gpullama-serve`` as node 0 answers the chat of one rank; killing node 1 turns /health into 503."""
    granite = tiny_model("granite", "F32").path
    want = LLM(str(granite), device="cpu", dtype="float32").chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    port = free_port()
    node1 = start_headless(granite, port, tmp_path / "node1.log")
    srv = start_server(granite, tmp_path / "server.log", ["--tensor-parallel-size", "2", "--nnodes", "2",
                                                          "--master-port", str(port)])
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12)
        assert out.choices[0].message.content == want.text
        node1.kill()
        node1.wait()
        with httpx.Client(base_url=srv.base_url, timeout=30) as http:
            deadline = time.monotonic() + 10
            while http.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert http.get("/health").status_code == 503
        assert "tensor-parallel node 1 (rank 1) is gone" in srv.log()
    finally:
        node1.kill()
        stop_server(srv)
    assert wait_gone([node1.pid]) == []


def test_torchrun_variables_make_each_process_one_node() -> None:
    args = EngineArgs(tensor_parallel_size=1)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    rdzv = Rendezvous.from_args(args, env)
    assert (rdzv.nnodes, rdzv.node_rank, rdzv.master_addr, rdzv.master_port, rdzv.agent_store) == \
        (2, 1, "10.0.0.1", 29400, True)
    assert rdzv.ranks_per_node(2) == 1 and rdzv.first_rank(2) == 1
    with pytest.raises(ValueError, match="tensor_parallel_size 4 differs from torchrun's WORLD_SIZE 2"):
        Rendezvous.from_args(EngineArgs(tensor_parallel_size=4), env)
    flags = Rendezvous.from_args(EngineArgs(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="h"), {})
    assert (flags.nnodes, flags.node_rank, flags.ranks_per_node(4), flags.first_rank(4)) == (2, 1, 2, 2)


@pytest.mark.parametrize("kwargs, message", [
    ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, "node_rank must be in 0..nnodes-1 \\(1\\)"),
    ({"nnodes": 2, "tensor_parallel_size": 3}, "tensor_parallel_size 3 must be a multiple of nnodes 2"),
    ({"master_port": 70000}, "master_port must be in 1..65535"),
])
def test_bad_node_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_torchrun_starts_both_ranks_of_the_server(tiny_model, tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m gpullama.server ...``: rank 0 serves (meeting rank 1 at torchrun's own
    store), rank 1 runs headless; the answer is one rank's, and SIGTERM to torchrun ends both."""
    granite = tiny_model("granite", "F32").path
    want = LLM(str(granite), device="cpu", dtype="float32").chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    http_port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = tmp_path / "torchrun.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "gpullama.server",
               "--model", str(granite), "--device", "cpu", "--dtype", "float32", "--port", str(http_port),
               "--api-key", API_KEY]
    with open(log, "wb") as out:
        run = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                               start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=API_KEY, max_retries=0,
                               timeout=60)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            assert run.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12)
        assert out.choices[0].message.content == want.text
        assert "tensor parallel: 2 ranks on 2 nodes" in log.read_text()
        everyone = [p.pid for p in psutil.Process(run.pid).children(recursive=True)]
        assert len(everyone) >= 2  # the two ranks
    finally:
        run.terminate()
        try:
            run.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, 9)
            raise
    assert wait_gone(everyone) == []
