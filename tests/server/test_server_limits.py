"""Limits with clear answers, CORS when configured, and a clean stop on SIGTERM, against a real server started with
small limits. The SIGTERM test ends that server, so it comes last in this module."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.server.conftest import Server, start_server, stop_server
from tests.server.helpers import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
REQUEST_TIMEOUT_S = 5
ORIGIN = "http://ui.example"
MAX_CONNECTIONS = 16
LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """A server with a waiting queue of 1 beside a batch of 4, a 5 s request timeout, 1 s header and body
    timeouts, a cap of 16 connections and one CORS origin."""
    srv = start_server(default_model_path, tmp_path_factory.mktemp("limited") / "server.log",
                       ["--max-queue", "1", "--max-num-seqs", "4", "--request-timeout", str(REQUEST_TIMEOUT_S),
                        "--header-timeout", "1", "--body-timeout", "1", "--max-connections", str(MAX_CONNECTIONS),
                        "--allowed-origins", ORIGIN])
    yield srv
    stop_server(srv)


def _port(srv: Server) -> int:
    return int(srv.base_url.rsplit(":", 1)[1])


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """Read until the server closes the socket (or `seconds` pass); returns what it sent."""
    sock.settimeout(seconds)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def test_idle_and_slow_header_connections_are_closed(limited: Server) -> None:
    with socket.create_connection(("127.0.0.1", _port(limited))) as idle:
        start = time.monotonic()
        assert _closed_within(idle, 5) == b""
        assert time.monotonic() - start < 4
    with socket.create_connection(("127.0.0.1", _port(limited))) as slow:
        start = time.monotonic()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        for _ in range(30):  # a header byte every 0.2 s would hold the connection forever without a head deadline
            try:
                slow.sendall(b"X")
            except OSError:
                closed = True
                break
            time.sleep(0.2)
        assert closed or _closed_within(slow, 1) == b""
        assert time.monotonic() - start < 4


def test_a_body_that_does_not_arrive_in_time_is_408(limited: Server) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", _port(limited))) as s:
        s.sendall(head + b'{"prompt": "')
        answer = _closed_within(s, 5)  # answered, then closed: the rest of the body would never be read
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer[:300]
    body = orjson.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"


def test_connections_past_the_cap_get_503(limited: Server) -> None:
    sockets = [socket.create_connection(("127.0.0.1", _port(limited))) for _ in range(MAX_CONNECTIONS)]
    try:
        over = httpx.get(f"{limited.base_url}/health", timeout=10)
        assert over.status_code == 503
    finally:
        for s in sockets:
            s.close()
    deadline = time.monotonic() + 60  # until the server has seen the 16 close: each freed a place
    while (after := httpx.get(f"{limited.base_url}/health", timeout=10).status_code) == 503:
        assert time.monotonic() < deadline, "the closed connections still count against the cap"
        time.sleep(0.05)
    assert after == 200


def test_cors_for_the_configured_origin_only(limited: Server) -> None:
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type, x-stainless-os"}
    ok = httpx.options(f"{limited.base_url}/v1/chat/completions", headers={"origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    answer = httpx.get(f"{limited.base_url}/v1/models", headers={"origin": ORIGIN, **AUTH})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{limited.base_url}/v1/chat/completions",
                          headers={"origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in httpx.get(f"{limited.base_url}/v1/models",
                                                          headers={"origin": "http://evil.example", **AUTH}).headers


def test_a_request_past_its_timeout_ends_with_504_or_an_error_event(limited: Server) -> None:
    async def run():
        async with httpx.AsyncClient(base_url=limited.base_url, timeout=60, headers=AUTH) as c:
            async def stream() -> list:
                async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                    return [line async for line in r.aiter_lines() if line]

            start = time.monotonic()
            streamed, whole = await asyncio.gather(stream(), c.post("/v1/completions", json=LONG))
            return streamed, whole, time.monotonic() - start

    streamed, whole, took = asyncio.run(run())
    assert REQUEST_TIMEOUT_S - 0.5 < took < REQUEST_TIMEOUT_S + 5
    assert whole.status_code == 504 and whole.json()["error"]["code"] == "request_timeout"
    assert streamed[-1] == "data: [DONE]"
    assert orjson.loads(streamed[-2][len("data: "):])["error"]["code"] == "request_timeout"
    assert len(streamed) > 3  # tokens were streamed before the deadline


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def _wait_for(base_url: str, name: str, value: float) -> None:
    deadline = time.monotonic() + 60
    while _metric(base_url, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def test_a_full_queue_answers_429_with_retry_after(limited: Server) -> None:
    async def run():
        async with httpx.AsyncClient(base_url=limited.base_url, timeout=60, headers=AUTH) as c:
            async def stream(opened: asyncio.Event) -> None:
                async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        opened.set()

            opened = [asyncio.Event() for _ in range(4)]
            running = [asyncio.create_task(stream(e)) for e in opened]  # the whole batch of 4
            await asyncio.gather(*(e.wait() for e in opened))
            queued = asyncio.create_task(c.post("/v1/completions", json=LONG))  # the one place in the queue
            await asyncio.to_thread(_wait_for, limited.base_url, "gpullama_requests_waiting", 1)
            refused = await c.post("/v1/completions", json=LONG)
            for task in [*running, queued]:
                task.cancel()
            await asyncio.gather(*running, queued, return_exceptions=True)
            return refused

    refused = asyncio.run(run())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and "--max-queue" in error["message"]
    _wait_for(limited.base_url, "gpullama_requests_running", 0)
    _wait_for(limited.base_url, "gpullama_requests_waiting", 0)
    ok = httpx.post(f"{limited.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200


def test_sigterm_ends_every_open_stream_and_exits_at_once(limited: Server) -> None:
    """Runs last: it stops the module's server."""
    async def run():
        async with httpx.AsyncClient(base_url=limited.base_url, timeout=60, headers=AUTH) as c:
            async def stream(i: int, opened: asyncio.Event) -> list[str]:
                lines = []
                async with c.stream("POST", "/v1/completions",
                                    json={**LONG, "prompt": f"Story number {i}:", "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                            opened.set()
                return lines

            opened = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(stream(i, e)) for i, e in enumerate(opened)]
            await asyncio.gather(*(e.wait() for e in opened))
            start = time.monotonic()
            limited.process.send_signal(signal.SIGTERM)
            ended = await asyncio.gather(*streams)
            return ended, start

    ended, start = asyncio.run(run())
    returncode = limited.process.wait(timeout=10)
    took = time.monotonic() - start
    assert returncode == 0 and took < 3, (returncode, took)
    for lines in ended:
        assert lines[-1] == "data: [DONE]"
        last = orjson.loads(lines[-2][len("data: "):])
        assert last.get("error", {}).get("code") == "engine_stopped" or last["choices"][0]["finish_reason"], last
    log = limited.log()
    assert "Traceback" not in log and "CancelledError" not in log
    assert "gpullama-serve stopped (SIGTERM)" in log


def test_sigint_ends_a_stream_and_exits_cleanly(default_model_path: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) is the same clean stop: no KeyboardInterrupt, no traceback, exit status 0."""
    srv = start_server(default_model_path, tmp_path / "server.log", ["--max-model-len", "512"])
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60, headers=AUTH) as c, \
                c.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 400, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            start = time.monotonic()
            srv.process.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert orjson.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_stopped"
        assert srv.process.wait(timeout=10) == 0 and time.monotonic() - start < 3
        log = srv.log()
        assert "Traceback" not in log and "KeyboardInterrupt" not in log and "stopped (SIGINT)" in log
    finally:
        stop_server(srv)
