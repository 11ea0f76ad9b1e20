"""One bad request never hurts another: poison and malformed bodies, a failing request in a shared batch,
browser-safety refusals, clients that hang up mid-upload, stream endings and the KV-pool gauges, against the real
shared server."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import httpx
import orjson
import pytest

from tests.server.conftest import FAULT_PROMPT, LATE_FAULT_PROMPT
from tests.server.helpers import API_KEY, sse_events

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD_PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time", "def fibonacci(n):"]
MESSAGES = [{"role": "user", "content": "Hi"}]
VOCAB = 49152  # SmolLM2's vocabulary


def _good_body(prompt: str) -> dict:
    return {"prompt": prompt, "temperature": 0, "max_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def solo(http: httpx.Client) -> list[str]:
    """Each good prompt's answer when it runs alone."""
    return [http.post("/v1/completions", json=_good_body(p)).json()["choices"][0]["text"] for p in GOOD_PROMPTS]


async def _stream(c: httpx.AsyncClient, body: dict, path: str = "/v1/completions",
                  running: asyncio.Event | None = None) -> list:
    """The stream's events; `running` is set once its first event has come (or once it has ended, however)."""
    try:
        async with c.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if running is not None and line.startswith("data: "):
                    running.set()
    finally:
        if running is not None:
            running.set()
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def _stream_text(events: list) -> tuple[str, str | None]:
    """The streamed text of a one-choice completion and its finish reason; the stream must end with [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if "choices" in e]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return text, reasons[-1] if reasons else None


def _client(server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url, timeout=120, headers=AUTH)


# Bodies that once failed every request in flight, answered 500, or blocked the event loop, each with the field a
# 400 must name (None: a 400 for the body as a whole, such as malformed JSON).
POISON: list[tuple[str, object, str | None]] = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "top_k": 10**30}, "top_k"),  # JSON parses it as a float
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(301)}},
     "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop_token_ids": [1] * 200_000}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["a"] * 100_000}, "stop"),
    ("/v1/completions", {"prompt": [VOCAB + 5], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [2**64 - 1], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["x"] * 50_000, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2**64 - 1}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**64 - 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": 2**64 - 1}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 100_000}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"1": 10**40}}, "logit_bias"),
]
RAW_POISON: list[bytes] = [  # not expressible as JSON from Python: huge or non-finite numbers
    b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}',
    b'{"prompt": "x", "max_tokens": 2, "temperature": 1e999}',
    b'{"prompt": "x", "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}",
    b'{"prompt": "x", "max_tokens": 2, "top_p": ' + b"9" * 500 + b"}",
    b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"5": ' + b"9" * 5000 + b"}}",
    b'{"prompt": "\\ud800", "max_tokens": 2}',
]


def test_poison_and_malformed_bodies_get_400_while_four_streams_finish_untouched(solo: list[str], server) -> None:
    mark = len(server.log())

    async def run() -> tuple[list, list[httpx.Response]]:
        async with _client(server) as c:
            running = [asyncio.Event() for _ in GOOD_PROMPTS]
            streams = [asyncio.create_task(_stream(c, _good_body(p), running=e)) for p, e in zip(GOOD_PROMPTS, running)]
            await asyncio.gather(*(e.wait() for e in running))  # the streams are running
            answers = [await c.post(path, json=body) for path, body, _ in POISON]
            answers += [await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
                        for raw in RAW_POISON]
            return await asyncio.gather(*streams), answers

    streams, answers = asyncio.run(run())
    for (path, body, param), answer in zip(POISON, answers):
        assert answer.status_code == 400, (path, str(body)[:200], answer.text[:300])
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if param is not None:
            assert error["param"] == param, (str(body)[:200], error)
    for raw, answer in zip(RAW_POISON, answers[len(POISON):]):
        assert answer.status_code == 400, (raw[:100], answer.text[:300])
    for events, want in zip(streams, solo):
        assert _stream_text(events) == (want, "length")
    assert "Traceback" not in server.log()[mark:]


def test_top_k_beyond_the_vocabulary_means_off(http: httpx.Client) -> None:
    """The int32 overflow of a huge top_k once failed the whole step; any top_k >= the vocabulary keeps every token."""
    def text(top_k: int) -> str:
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 11, "top_k": top_k}
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    off = text(0)
    assert text(2**31) == off and text(2**64 - 1) == off and text(VOCAB) == off


def test_a_failing_request_fails_alone_and_the_batch_goes_on(http: httpx.Client, server, solo: list[str]) -> None:
    """The sampling of any step carrying a fault prompt raises (conftest's launcher). The engine finds the row at
    fault; that request ends (500 before its first token, an error event then [DONE] after it), and the four
    streams sharing its steps finish with their solo answers."""

    async def run():
        async with _client(server) as c:
            streams = [asyncio.create_task(_stream(c, _good_body(p))) for p in GOOD_PROMPTS]
            late = asyncio.create_task(_stream(c, {"prompt": LATE_FAULT_PROMPT, "max_tokens": 12}))
            early = await c.post("/v1/completions", json={"prompt": FAULT_PROMPT, "max_tokens": 12})
            return await asyncio.gather(*streams), await late, early

    streams, late, early = asyncio.run(run())
    assert early.status_code == 500 and early.json()["error"]["code"] == "generation_failed"
    assert late[-1] == "[DONE]" and "error" in late[-2], late[-3:]
    assert late[-2]["error"]["type"] == "server_error"
    assert late[-2]["error"]["message"].startswith("internal error (request id ")
    assert any(e.get("choices") and e["choices"][0]["text"] for e in late[:-2] if isinstance(e, dict))  # it started
    for events, want in zip(streams, solo):
        assert _stream_text(events) == (want, "length")
    assert http.get("/health").status_code == 200


def test_only_json_bodies_are_accepted(http: httpx.Client) -> None:
    body = orjson.dumps({"prompt": "x", "max_tokens": 1})
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x"):
        answer = http.post("/v1/completions", content=body, headers={"content-type": content_type})
        assert answer.status_code == 415, (content_type, answer.text)
        assert answer.json()["error"]["code"] == "unsupported_media_type"
    no_type = http.build_request("POST", "/v1/completions", content=body)
    no_type.headers.pop("content-type", None)
    assert http.send(no_type).status_code == 415
    ok = http.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_only_loopback_host_names_are_accepted(http: httpx.Client, server) -> None:
    port = server.base_url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", f"192.168.1.10:{port}", "localhost.evil.example"):
        answer = http.get("/v1/models", headers={"host": host})
        assert 400 <= answer.status_code < 500, host
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost", f"app.localhost:{port}"):
        assert http.get("/v1/models", headers={"host": host}).status_code == 200, host


def test_no_cors_unless_configured(server) -> None:
    preflight = httpx.options(f"{server.base_url}/v1/chat/completions",
                              headers={"origin": "http://evil.example", "access-control-request-method": "POST",
                                       "access-control-request-headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    answer = httpx.get(f"{server.base_url}/health", headers={"origin": "http://evil.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_mid_upload_disconnects_are_quiet_and_leave_the_server_fast(http: httpx.Client, server) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    mark = len(server.log())
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()
    for _ in range(30):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(head + b'{"prompt": "' + b"a" * 2000)
    start = time.perf_counter()
    ok = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and time.perf_counter() - start < 5
    deadline = time.monotonic() + 60
    while server.log()[mark:].count("client disconnected during the upload") < 30:
        assert time.monotonic() < deadline, server.log()[mark:][-3000:]
        time.sleep(0.1)
    log = server.log()[mark:]
    assert "Traceback" not in log
    statuses = re.findall(r'"POST /v1/completions HTTP/1.1" (\d+)', log)
    assert statuses.count("499") == 30 and not [s for s in statuses if s.startswith("5")], statuses


def test_completed_streams_log_no_disconnect(http: httpx.Client, server) -> None:
    mark = len(server.log())
    for _ in range(3):
        with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
            assert sse_events(r)[-1] == "[DONE]"
    deadline = time.monotonic() + 60
    while server.log()[mark:].count('"POST /v1/completions HTTP/1.1" 200') < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "client disconnected" not in server.log()[mark:]


def _metrics(http: httpx.Client) -> dict[str, float]:
    """The unlabelled samples of one /metrics answer."""
    samples = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _wait_metric(http: httpx.Client, name: str, check, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while not check(value := _metrics(http)[name]):
        assert time.monotonic() < deadline, f"{name} = {value}"
        time.sleep(0.05)
    return value


def test_metrics_show_the_kv_blocks_in_use_and_total(http: httpx.Client) -> None:
    total = _metrics(http)["gpullama_kv_blocks_total"]
    assert total > 0
    _wait_metric(http, "gpullama_kv_blocks_used", lambda v: v == 0)  # idle: nothing held
    body = {"prompt": "Once upon a time " * 20, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        now = _metrics(http)
        used = now["gpullama_kv_blocks_used"]
        assert 5 <= used < total  # some 80 prompt tokens, in blocks of 16
        assert now["gpullama_kv_blocks_total"] == total
        assert now["gpullama_kv_cache_usage_ratio"] == pytest.approx(used / total)
    _wait_metric(http, "gpullama_kv_blocks_used", lambda v: v == 0)  # the cancelled stream's blocks came back
