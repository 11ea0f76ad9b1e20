"""llama.cpp's server-wide flags against one real server started with all of them: ``--chat-template`` (llama.cpp's
real DeepSeek-R1-Distill template, from its source tree), ``--reasoning off``, ``--no-prefill-assistant``,
``--pooling none``, ``--temp``, ``--seed``, ``-n`` and ``--verbose``; each checked in the shapes of llama.cpp's
``tools/server/README.md``. Its steps hold 64 tokens, so a short prompt prefills in several chunks (the prompt
progress of ``return_progress``)."""

from __future__ import annotations

import uuid

import httpx
import numpy as np
import orjson
import pytest

from tests.fixtures.llamacpp_source import llamacpp_source
from tests.server.conftest import start_server, stop_server
from tests.server.helpers import API_KEY, sse_events

R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def flagged(default_model_path, tmp_path_factory):
    """(httpx client, the template's text) of a server on the default model with llama.cpp's flags set."""
    template = llamacpp_source() / "models" / "templates" / R1
    srv = start_server(default_model_path, tmp_path_factory.mktemp("flagged") / "server.log",
                       ["--chat-template-file", str(template), "--reasoning", "off", "--no-prefill-assistant",
                        "--pooling", "none", "--temp", "0.7", "--seed", "7", "-n", "6", "--verbose",
                        "--max-num-batched-tokens", "64"])
    with httpx.Client(base_url=srv.base_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        yield http, template.read_text(encoding="utf-8")
    stop_server(srv)


def test_reasoning_off_and_no_prefill_reach_every_render(flagged):
    http, source = flagged
    assert http.get("/props").json()["chat_template"] == source
    off = http.post("/apply-template", json={"messages": USER}).json()["prompt"]
    assert off.endswith("<｜Assistant｜><think>\n</think>")  # --reasoning off: the template closes the block
    on = http.post("/apply-template", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": True}})
    assert on.json()["prompt"].endswith("<｜Assistant｜><think>\n")  # the request's boolean wins
    bad = http.post("/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": "1"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
    prefill = [*USER, {"role": "assistant", "content": "The answer is"}]
    whole = http.post("/apply-template", json={"messages": prefill}).json()["prompt"]
    assert whole.endswith("<｜Assistant｜><think>\n</think>")  # the last message is a whole turn, not continued
    counted = http.post("/tokenize", json={"messages": USER}).json()["count"]
    assert http.post("/v1/chat/completions/input_tokens", json={"messages": USER}).json()["input_tokens"] == counted


def test_pooling_none_gives_every_tokens_vector_natively_only(flagged):
    http, _ = flagged
    ids = http.post("/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"]
    rows = http.post("/embeddings", json={"input": "Hello world"}).json()
    assert len(rows) == 1 and len(rows[0]["embedding"]) == len(ids)  # one unnormalised row per token
    assert any(abs(np.linalg.norm(row) - 1) > 0.1 for row in rows[0]["embedding"])
    assert rows == http.post("/embeddings", json={"input": "Hello world", "embd_normalize": 2}).json()
    for path, body, param in (("/v1/embeddings", {"input": "Hello"}, "input"),
                              ("/api/embed", {"input": "Hello"}, "input")):
        out = http.post(path, json=body)
        assert out.status_code == 400 and "not OAI compatible" in out.text, out.text
        if path.startswith("/v1"):
            assert out.json()["error"]["param"] == param


def test_temp_seed_and_n_predict_are_the_defaults(flagged):
    http, _ = flagged
    settings = http.get("/props").json()["default_generation_settings"]["params"]
    assert settings["temperature"] == 0.7 and settings["seed"] == 7 and settings["n_predict"] == 6
    body = {"prompt": "Once upon a time"}
    first, second = (http.post("/completion", json=body).json() for _ in range(2))
    given = first["generation_settings"]
    assert given["temperature"] == 0.7 and given["seed"] == 7 and given["n_predict"] == 6
    assert first["content"] == second["content"] and first["tokens_predicted"] <= 6
    with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        streamed = "".join(e["content"] for e in sse_events(r))
    assert streamed == first["content"]
    assert http.post("/completion", json={**body, "n_predict": 2, "seed": 1}).json()["generation_settings"][
        "n_predict"] == 2  # a request's own values win
    chat = {"messages": USER}
    whole = http.post("/v1/chat/completions", json=chat).json()
    assert whole["usage"]["completion_tokens"] <= 6
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    text = "".join((c["choices"][0]["delta"].get("content") or "") + (c["choices"][0]["delta"].get(
        "reasoning_content") or "") for c in chunks if c["choices"])
    message = whole["choices"][0]["message"]
    assert text == (message["content"] or "") + (message.get("reasoning_content") or "")


def test_verbose_puts_the_native_result_on_every_answer(flagged):
    http, _ = flagged
    out = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
    prompt = http.post("/apply-template", json={"messages": USER}).json()["prompt"]
    assert out["__verbose"]["prompt"] == prompt and out["__verbose"]["tokens_evaluated"] == out["usage"][
        "prompt_tokens"]
    assert "__verbose" not in http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2,
                                                                       "verbose": False}).json()
    with http.stream("POST", "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True}) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][0]
    assert last["__verbose"]["prompt"] == prompt and last["__verbose"]["stop_type"] == "limit"
    text = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).json()
    assert text["__verbose"]["prompt"] == "Hello"


def _long_prompt() -> str:
    """A prompt of about 200 tokens no earlier request shares (so it prefills in 3 or more chunks of 64)."""
    return f"{uuid.uuid4().hex} " + " ".join(f"item{i}" for i in range(50))


def _chunked(progress: list[dict]) -> None:
    """llama.cpp's progress: first the cached tokens (before any chunk), then one event per chunk to the total."""
    processed = [p["processed"] for p in progress]
    assert processed[0] == progress[0]["cache"] and progress[0]["time_ms"] == 0
    assert len(processed) >= 3 and processed == sorted(set(processed)) and processed[-1] == progress[-1]["total"]
    assert [p["time_ms"] for p in progress] == sorted(p["time_ms"] for p in progress)


def test_return_progress_reports_each_prefill_chunk_on_every_streaming_api(flagged):
    """return_progress with stream: a first event before prefill, then one per prefill chunk until processed ==
    total, all before the first token: /completion's events, chat's chunks (an empty assistant delta), Responses'
    response.in_progress events. Chat's timings go on the usage chunk with include_usage, on every delta with
    timings_per_token."""
    http, _ = flagged
    with http.stream("POST", "/completion", json={"prompt": _long_prompt(), "n_predict": 2, "stream": True,
                                                  "return_progress": True}) as r:
        events = sse_events(r)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    _chunked(progress)
    assert all("prompt_progress" in e for e in events[: len(progress)])  # before any token
    messages = [{"role": "user", "content": _long_prompt()}]
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 2, "stream": True, "return_progress": True,
            "timings_per_token": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    marked = [c for c in chunks if "prompt_progress" in c]
    _chunked([c["prompt_progress"] for c in marked])
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in marked)
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content and all("timings" in c for c in content)
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert "timings" not in finish[0] and chunks[-1]["choices"] == [] and "timings" in chunks[-1]
    assert chunks[-1]["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"]
    whole = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "return_progress": True})
    assert whole.status_code == 200 and "prompt_progress" not in whole.text  # progress is only streamed
    with http.stream("POST", "/v1/responses", json={"input": _long_prompt(), "max_output_tokens": 2, "stream": True,
                                                    "return_progress": True}) as r:
        responses = [orjson.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    in_progress = [e for e in responses if e["type"] == "response.in_progress" and "prompt_progress" in e]
    _chunked([e["prompt_progress"] for e in in_progress])
    assert [e["sequence_number"] for e in responses] == list(range(len(responses)))
