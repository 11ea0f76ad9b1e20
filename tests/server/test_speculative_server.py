"""`gpullama-serve --speculative-config`: a server with n-gram speculation answers greedy requests (plain and
streamed, with logprobs and usage) exactly as the plain shared server does, and counts drafts in /metrics."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, serve_command, start_server, stop_server
from tests.server.helpers import API_KEY, sse_events

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CODE = """def mean(values):
    total = 0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    return total / count
"""
BODY = {"messages": [{"role": "user", "content": f"Rename `total` to `acc` and return the function.\n\n{CODE}"}],
        "max_tokens": 60, "temperature": 0, "logprobs": True, "top_logprobs": 2}


@pytest.fixture(scope="module")
def speculative(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    srv = start_server(default_model_path, tmp_path_factory.mktemp("speculative") / "server.log",
                       ["--speculative-config", json.dumps(config), "--log-stats-interval", "1"])
    yield srv
    stop_server(srv)


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_speculative_server_answers_as_the_plain_one(speculative: Server, server: Server, model_name: str) -> None:
    body = {**BODY, "model": model_name}
    with httpx.Client(base_url=speculative.base_url, headers=AUTH, timeout=120) as spec, \
            httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as plain:
        want = plain.post("/v1/chat/completions", json=body).json()
        got = spec.post("/v1/chat/completions", json=body).json()
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        # the token counts; cached_tokens depends on what each server's prefix cache held before (the shared plain
        # server has answered other tests' requests with the same system prompt)
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: got["usage"][k] for k in counts} == {k: want["usage"][k] for k in counts}
        got_lp, want_lp = got["choices"][0]["logprobs"]["content"], want["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in got_lp] == [e["token"] for e in want_lp]
        assert all(abs(a["logprob"] - b["logprob"]) < 1e-3 for a, b in zip(got_lp, want_lp))
        with spec.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            events = [e for e in sse_events(response) if e != "[DONE]"]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert text == want["choices"][0]["message"]["content"]
        metrics = spec.get("/metrics").text
    accepted = _metric(metrics, "gpullama_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= _metric(metrics, "gpullama_spec_decode_num_draft_tokens_total")
    # llama.cpp's names of the same counters, and its count of verification steps
    assert _metric(metrics, "llamacpp:spec_decode_num_accepted_tokens_total") == accepted
    assert _metric(metrics, "llamacpp:spec_decode_num_draft_tokens_total") == _metric(
        metrics, "gpullama_spec_decode_num_draft_tokens_total")
    assert _metric(metrics, "llamacpp:spec_decode_num_drafts_total") > 0


def test_bad_speculative_config_is_refused_before_loading() -> None:
    """A wrong key exits with status 2 and names it, before anything loads."""
    done = subprocess.run([*serve_command(), "--speculative-config", '{"method": "ngram", "k": 3}'],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "unknown key(s) 'k'" in done.stderr, (done.returncode, done.stderr)
