"""The server log a person reads: one line per request with its tokens, speed and finish reason (or why it was
refused), a periodic engine status line while it works, health polls kept out of the info log."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.server.conftest import Server

ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3}) (?P<rest>.*)$')


def new_lines(server: Server, start: int, wanted: re.Pattern | str, timeout: float = 10) -> list[str]:
    """Log lines written after byte `start`, waiting until one matches `wanted` (a line is logged once the
    response is complete, which can be just after the client has it)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = server.log()[start:].splitlines()
        if any(re.search(wanted, line) for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def access_line(lines: list[str], method: str, path: str) -> re.Match:
    found = [m for m in map(ACCESS.search, lines) if m and (m["method"], m["path"]) == (method, path)]
    assert len(found) == 1, lines
    return found[0]


def test_a_generation_logs_its_tokens_first_token_speed_and_finish(server: Server, client: openai.OpenAI,
                                                                   model_name: str) -> None:
    start = len(server.log())
    out = client.chat.completions.create(model=model_name, temperature=0, max_tokens=12,
                                         messages=[{"role": "user", "content": "Count from one to twenty."}])
    line = access_line(new_lines(server, start, "POST /v1/chat/completions"), "POST", "/v1/chat/completions")
    assert line["status"] == "200"
    rest = line["rest"]
    usage = out.usage
    assert f"prompt {usage.prompt_tokens} tokens" in rest and f"generated {usage.completion_tokens} tokens" in rest
    assert f"finish {out.choices[0].finish_reason}" in rest
    took = re.match(r"([\d.]+)(ms|s)", rest)
    seconds = float(took[1]) / (1000 if took[2] == "ms" else 1)
    ttft = float(re.search(r"first token ([\d.]+)s", rest)[1])
    speed = float(re.search(r"([\d.]+) tokens/s", rest)[1])
    assert 0 < ttft <= seconds + 0.01 and speed > 0, rest


def test_a_stream_logs_its_totals_when_it_ends(server: Server, http: httpx.Client, model_name: str) -> None:
    start = len(server.log())
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 9, "ignore_eos": True, "stream": True,
            "n": 2}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        r.read()
    rest = access_line(new_lines(server, start, "POST /v1/completions"), "POST", "/v1/completions")["rest"]
    assert "generated 18 tokens" in rest and "finish length,length" in rest, rest


@pytest.mark.parametrize("case", ["bad_value", "bad_key", "no_route"])
def test_a_refused_request_logs_the_reason(server: Server, http: httpx.Client, model_name: str, case: str) -> None:
    start = len(server.log())
    if case == "bad_value":
        r = http.post("/v1/chat/completions", json={"model": model_name, "temperature": -1,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        method, path = "POST", "/v1/chat/completions"
    elif case == "bad_key":
        r = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer wrong"})
        method, path = "GET", "/v1/models"
    else:
        r = http.get("/v1/nothing-here")
        method, path = "GET", "/v1/nothing-here"
    assert 400 <= r.status_code < 500
    line = access_line(new_lines(server, start, path), method, path)
    assert line["status"] == str(r.status_code)
    assert r.json()["error"]["message"] in line["rest"], line["rest"]


def test_health_polls_stay_out_of_the_info_log(server: Server, http: httpx.Client) -> None:
    start = len(server.log())
    for _ in range(3):
        assert http.get("/health").status_code == 200
    http.get("/v1/models")  # a request that is logged, so the health lines would be there by now
    lines = new_lines(server, start, "GET /v1/models")
    assert not [line for line in lines if "/health" in line], lines


def test_engine_status_line_while_busy(server: Server, http: httpx.Client, model_name: str) -> None:
    """The fixture runs the server with --log-stats-interval 1: a request that generates for a few seconds is seen
    running, with its KV blocks in use and tokens coming out."""
    start = len(server.log())
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 80, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    status = re.compile(r"engine: (\d+) running, (\d+) waiting; KV cache ([\d.]+)% used \((\d+) of (\d+) tokens\); "
                        r"prompt ([\d.]+) tokens/s, generation ([\d.]+) tokens/s; prefix cache hits (\S+)")
    lines = new_lines(server, start, status)
    busy = [m for m in map(status.search, lines) if m and m[1] == "1"]
    assert busy, lines
    running, waiting, used_pct, used, total, prompt_tps, gen_tps, hits = busy[-1].groups()
    assert int(waiting) == 0 and 0 < int(used) <= 96 and float(gen_tps) > 0  # 4 + 80 tokens: at most 6 blocks
    assert abs(float(used_pct) - 100 * int(used) / int(total)) < 0.1
