"""``gpullama-serve --tensor-parallel-size 2`` on the CPU: it answers a chat as the one-rank library does, reports
itself unhealthy once a worker dies (the stream in flight and later requests fail at once instead of waiting), and
leaves no process behind."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from gpullama import LLM, SamplingParams
from tests.server.conftest import Server, start_server, stop_server
from tests.server.helpers import API_KEY
from tests.test_tensor_parallel import wait_gone

CHAT = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


def _descendants(srv: Server) -> tuple[list[int], list[int]]:
    """(every process the server started, the tensor-parallel workers among them)."""
    children = psutil.Process(srv.process.pid).children(recursive=True)
    workers = [p.pid for p in children if any("spawn_main" in part for part in p.cmdline())]
    return [p.pid for p in children], workers


@pytest.fixture(scope="module")
def granite(tiny_model) -> Path:
    """A tiny Granite (4 q / 2 KV heads, its multipliers, tied head) with a ChatML template."""
    return tiny_model("granite", "F32").path


def test_two_rank_server_answers_the_chat_of_one_rank_and_stops_cleanly(granite: Path, tmp_path: Path) -> None:
    want = LLM(str(granite), device="cpu", dtype="float32").chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    srv = start_server(granite, tmp_path / "server.log", ["--tensor-parallel-size", "2"])
    try:
        everyone, workers = _descendants(srv)
        assert len(workers) == 1
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12)
        assert out.choices[0].message.content == want.text
        assert out.choices[0].finish_reason == want.finish_reason
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                          len(want.token_ids))
    finally:
        stop_server(srv)  # SIGTERM: the engine stops, then the workers
    assert srv.process.returncode == 0, srv.log()[-3000:]
    assert wait_gone(everyone) == []


def test_a_dead_worker_makes_the_server_unhealthy(granite: Path, tmp_path: Path) -> None:
    srv = start_server(granite, tmp_path / "server.log", ["--tensor-parallel-size", "2"])
    try:
        everyone, (worker,) = _descendants(srv)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=srv.base_url, headers=headers, timeout=30) as http:
            assert http.get("/health").status_code == 200
            model = http.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 180,
                    "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")  # generating: the worker dies mid-stream
                psutil.Process(worker).kill()
                started = time.monotonic()
                rest = [line for line in lines if line]
            # the stream ends at once with an error event, then [DONE]
            assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2] and time.monotonic() - started < 5
            deadline = time.monotonic() + 10
            while http.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            health = http.get("/health")
            assert health.status_code == 503, health.text
            started = time.monotonic()
            reply = http.post("/v1/chat/completions", json={"model": "x", "messages": CHAT, "max_tokens": 4})
            assert reply.status_code == 503 and time.monotonic() - started < 5
        assert "tensor-parallel rank 1" in srv.log() and "exited" in srv.log()
    finally:
        stop_server(srv)
    assert wait_gone(everyone) == []
