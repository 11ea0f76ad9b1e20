"""Concurrency, cancellation, health/models/metrics, start-up and logging of the real server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.server.conftest import serve_command
from tests.server.helpers import API_KEY

PROMPTS = ["The capital of France is", "My favourite colour is", "Water boils at", "The best way to learn is",
           "Once upon a time", "The largest planet is", "In 1492,", "def fibonacci(n):"]


def test_parallel_requests_equal_their_solo_answers(http: httpx.Client, server, model_name: str) -> None:
    def body(prompt: str) -> dict:
        return {"model": model_name, "prompt": prompt, "temperature": 0, "max_tokens": 10}

    solo = [http.post("/v1/completions", json=body(p)).json()["choices"][0]["text"] for p in PROMPTS]
    assert len(set(solo)) > 1

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            answers = await asyncio.gather(*(c.post("/v1/completions", json=body(p)) for p in PROMPTS))
        return [a.json()["choices"][0]["text"] for a in answers]

    assert asyncio.run(together()) == solo


def _metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def test_cancelled_stream_stops_generation_and_the_next_request_works(http: httpx.Client, server,
                                                                       model_name: str) -> None:
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 2:
                break
    # 4000 tokens would take minutes here; the engine is idle again a step or two after the cancel (the ceiling
    # leaves room for a busy machine and still stays far below those minutes)
    deadline = time.monotonic() + 30
    while _metric(http, "gpullama_requests_running") > 0:
        assert time.monotonic() < deadline, "the cancelled request is still running"
        time.sleep(0.05)
    assert "client disconnected mid-stream" in server.log()
    ok = http.post("/v1/chat/completions", json={"model": model_name, "temperature": 0, "max_tokens": 16, "messages": [
        {"role": "user", "content": "What is the capital of France? Answer with one word."}]})
    assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"]


def test_health_models_and_metrics(http: httpx.Client, server, model_name: str) -> None:
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["object"] == "model" and card["id"] == model_name and card["max_model_len"] > 0
    assert http.get(f"/v1/models/{model_name}").json()["id"] == model_name
    text = httpx.get(f"{server.base_url}/metrics").text  # open without the key, like /health
    for name in ("gpullama_http_requests_total", "gpullama_prompt_tokens_total", "gpullama_generation_tokens_total",
                 "gpullama_time_to_first_token_seconds_bucket", "gpullama_inter_token_latency_seconds_bucket",
                 "gpullama_requests_running", "gpullama_requests_waiting"):
        assert name in text, name
    before = _metric(http, "gpullama_generation_tokens_total")
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert _metric(http, "gpullama_generation_tokens_total") == before + 3
    assert 'gpullama_http_requests_total{route="/v1/completions",status="200"}' in http.get("/metrics").text


def test_while_loading_health_and_routes_answer_503(server) -> None:
    # recorded by the fixture while the model loaded (the socket is up before the model)
    assert server.loading_answers, "the server never answered while loading"
    for path, status, body in server.loading_answers:
        assert status == 503
        if path == "/health":
            assert body == {"status": "loading"}
        else:
            assert body["error"]["code"] == "model_loading"


def test_startup_and_access_logs(server) -> None:
    log = server.log()
    assert "device" in log and "ready on device cpu" in log
    assert f"http://127.0.0.1:{server.base_url.rsplit(':', 1)[1]}" in log
    assert "KV cache" in log
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert '"GET /health' not in log  # the fixture's polls, 503s while loading too: debug level (test_logs.py)


def test_console_script_help() -> None:
    help_text = subprocess.run([*serve_command(), "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "--max-model-len" in help_text.stdout


def test_smoke_script_passes_against_the_server(server) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "server-smoke-test.sh"
    env = dict(os.environ, GPULLAMA_API_KEY=API_KEY)
    run = subprocess.run(["bash", str(script), server.base_url], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("9 passed, 0 failed")
