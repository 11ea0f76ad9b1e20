"""Several models in one ``gpullama-serve`` (issue 36): the real SmolLM2 GGUF as the default model, two tiny random
llamas and a corrupt file from ``--models-dir``, at most two loaded at once. Each request gets its own model's
answer (compared with `LLM` on that file), in every API family; models load on demand and unload by keep-alive, by
request and to make room (least recently used first); an unknown model is a 404 naming the served ones; the corrupt
file fails only its own requests."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest

from gpullama import LLM, SamplingParams
from tests.server.conftest import start_server, stop_server
from tests.server.helpers import API_KEY

PROMPT = "The capital of France is"
TOKENS = 8


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model) -> Path:
    """tiny-a and tiny-b (two random llamas), broken.gguf (a truncated GGUF) and a projector file to skip."""
    folder = tmp_path_factory.mktemp("models")
    shutil.copy(tiny_model("llama", seed=0).path, folder / "tiny-a.gguf")
    shutil.copy(tiny_model("llama", seed=1).path, folder / "tiny-b.gguf")
    whole = (folder / "tiny-a.gguf").read_bytes()
    (folder / "broken.gguf").write_bytes(whole[: len(whole) // 2])
    (folder / "mmproj-tiny.gguf").write_bytes(whole)
    return folder


@pytest.fixture(scope="module")
def multi(default_model_path: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(None, tmp_path_factory.mktemp("multi") / "server.log",
                       ["--model", f"smol={default_model_path}", "--models-dir", str(models_dir),
                        "--max-loaded-models", "2", "--keep-alive", "10m", "--log-stats-interval", "0"])
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(multi) -> httpx.Client:
    with httpx.Client(base_url=multi.base_url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def reference(default_llm, models_dir: Path) -> dict[str, str]:
    """Each model's greedy continuation of PROMPT, from `LLM` on its file."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    answers = {"smol": default_llm.generate([PROMPT], params)[0].outputs[0].text}
    for name in ("tiny-a", "tiny-b"):
        llm = LLM(str(models_dir / f"{name}.gguf"), device="cpu", dtype="float32")
        answers[name] = llm.generate([PROMPT], params)[0].outputs[0].text
        del llm
    assert len(set(answers.values())) == 3  # the models are told apart by their answers
    return answers


def _complete(http: httpx.Client, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS, "ignore_eos": True, **extra}
    if model is not None:
        body["model"] = model
    return http.post("/v1/completions", json=body)


def _status(http: httpx.Client) -> dict[str, str]:
    data = http.get("/v1/models").json()["data"]
    return {card["id"]: card["status"]["value"] + ("/failed" if card["status"].get("failed") else "")
            for card in data}


def _loaded(http: httpx.Client) -> set[str]:
    return {m["name"] for m in http.get("/api/ps").json()["models"]}


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_every_model_is_listed_with_its_state(http: httpx.Client) -> None:
    status = _status(http)
    assert list(status) == ["smol", "broken", "tiny-a", "tiny-b"]  # the default first; mmproj-*.gguf skipped
    assert status["smol"] == "loaded"  # the default loads at start
    assert status["broken"] == "unloaded/failed"  # its file was refused at start
    assert http.get("/models").json()["data"] == http.get("/v1/models").json()["data"]  # llama.cpp's /models
    tags = http.get("/api/tags").json()["models"]
    assert [t["name"] for t in tags] == list(status)
    assert {t["name"]: t["details"]["family"] for t in tags if t["name"] != "broken"} == {
        "smol": "llama", "tiny-a": "llama", "tiny-b": "llama"}
    assert http.get("/v1/models/tiny-b").json()["status"] == {"value": _status(http)["tiny-b"].split("/")[0]}


def test_each_request_gets_its_own_models_answer_interleaved(multi, http: httpx.Client, reference) -> None:
    names = ["smol", "tiny-a"] * 3

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=multi.base_url, timeout=300,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            answers = await asyncio.gather(*(c.post("/v1/completions", json={
                "model": n, "prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS, "ignore_eos": True})
                for n in names))
        return [(a.json()["model"], a.json()["choices"][0]["text"]) for a in answers]

    assert asyncio.run(together()) == [(n, reference[n]) for n in names]
    assert _complete(http, None).json()["choices"][0]["text"] == reference["smol"]  # no model: the default


def test_every_api_family_routes_by_model(http: httpx.Client, reference) -> None:
    want = reference["tiny-a"]
    native = http.post("/completion", json={"model": "tiny-a", "prompt": PROMPT, "temperature": 0,
                                            "n_predict": TOKENS, "ignore_eos": True}).json()
    assert native["content"] == want and native["model"] == "tiny-a"
    ollama = http.post("/api/generate", json={"model": "tiny-a", "prompt": PROMPT, "raw": True, "stream": False,
                                              "options": {"temperature": 0, "num_predict": TOKENS}}).json()
    assert ollama["model"] == "tiny-a" and want.startswith(ollama["response"])  # it may stop at EOS
    hidden = {"smol": 576, "tiny-a": 64}
    for name, size in hidden.items():
        openai_vec = http.post("/v1/embeddings", json={"model": name, "input": "hello"}).json()["data"][0]
        ollama_vec = http.post("/api/embed", json={"model": name, "input": "hello"}).json()["embeddings"][0]
        assert len(openai_vec["embedding"]) == len(ollama_vec) == size
    chat = http.post("/v1/chat/completions", json={"model": "smol", "max_tokens": 4, "temperature": 0,
                                                   "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["model"] == "smol"
    anthropic = http.post("/v1/messages", json={"model": "smol", "max_tokens": 4, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert anthropic["model"] == "smol" and anthropic["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    responses = http.post("/v1/responses", json={"model": "smol", "input": "Hi", "max_output_tokens": 4,
                                                 "temperature": 0}).json()
    assert responses["model"] == "smol"
    tokens = http.post("/tokenize", json={"model": "tiny-a", "prompt": PROMPT}).json()
    assert tokens["max_model_len"] != http.post("/tokenize", json={"model": "smol", "prompt": PROMPT}).json()[
        "max_model_len"]
    assert http.get("/props", params={"model": "tiny-a"}).json()["model_alias"] == "tiny-a"
    shown = http.post("/api/show", json={"name": "tiny-a:latest"}).json()  # Ollama's older field and tag
    assert shown["parameters"] == f"num_ctx {tokens['max_model_len']}"


def test_an_unknown_model_is_a_404_naming_the_served_ones(http: httpx.Client) -> None:
    served = ("smol", "broken", "tiny-a", "tiny-b")
    openai_error = _complete(http, "nope")
    assert openai_error.status_code == 404
    assert openai_error.json()["error"]["code"] == "model_not_found"
    assert all(f"`{n}`" in openai_error.json()["error"]["message"] for n in served)
    ollama_error = http.post("/api/chat", json={"model": "nope", "messages": [{"role": "user", "content": "Hi"}]})
    assert ollama_error.status_code == 404 and all(f"'{n}'" in ollama_error.json()["error"] for n in served)
    anthropic_error = http.post("/v1/messages", json={"model": "nope", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
    assert anthropic_error.status_code == 404 and anthropic_error.json()["error"]["type"] == "not_found_error"
    assert http.get("/v1/models/nope").status_code == 404
    assert http.post("/models/load", json={"model": "nope"}).status_code == 404


def test_a_corrupt_file_fails_only_its_own_requests(http: httpx.Client, reference) -> None:
    for name in ("tiny-a", "smol"):  # at --max-loaded-models 2: a load would unload tiny-a to make room
        assert http.post("/models/load", json={"model": name}).json()["success"] is True
    assert _loaded(http) == {"tiny-a", "smol"}
    for _ in range(2):  # each request tries again, and fails again
        failed = _complete(http, "broken")
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "model_load_failed"
        assert "model 'broken' failed to load" in failed.json()["error"]["message"]
    assert _status(http)["broken"] == "unloaded/failed"
    assert _loaded(http) == {"tiny-a", "smol"}  # the file was refused before any model was unloaded for it
    assert _complete(http, "smol").json()["choices"][0]["text"] == reference["smol"]
    assert http.get("/health").status_code == 200


def test_keep_alive_0_unloads_and_memory_is_given_back(multi, http: httpx.Client, reference) -> None:
    assert _complete(http, "smol").status_code == 200
    assert "smol" in _loaded(http)
    before = _rss_bytes(multi.process.pid)
    unload = http.post("/api/generate", json={"model": "smol", "keep_alive": 0}).json()
    assert unload["done_reason"] == "unload"
    assert "smol" not in _loaded(http) and _status(http)["smol"] == "unloaded"
    deadline = time.monotonic() + 60  # the heap is trimmed at once and again a second later
    while (after := _rss_bytes(multi.process.pid)) > before - 200 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert before - after > 200 * 2**20, (before, after)  # float32 SmolLM2's weights alone are 540 MB
    # the next requests load it again, once for all of them, with the same answer; tiny-a answers meanwhile
    loads = multi.log().count("loading model smol from")
    names = ["smol", "tiny-a", "smol"]

    async def together() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=multi.base_url, timeout=300,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            answers = await asyncio.gather(*(c.post("/v1/completions", json={
                "model": n, "prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS, "ignore_eos": True})
                for n in names))
        return [(a.json()["model"], a.json()["choices"][0]["text"]) for a in answers]

    assert asyncio.run(together()) == [(n, reference[n]) for n in names]
    assert multi.log().count("loading model smol from") == loads + 1
    # a request's keep_alive 0: unloaded once it is answered
    done = http.post("/api/generate", json={"model": "tiny-a", "prompt": PROMPT, "raw": True, "stream": False,
                                            "keep_alive": 0, "options": {"temperature": 0, "num_predict": 2}})
    assert done.status_code == 200 and "tiny-a" not in _loaded(http)
    # ps says until when: keep_alive -1 is forever, a duration from now
    http.post("/api/generate", json={"model": "tiny-a", "keep_alive": -1})
    http.post("/api/generate", json={"model": "smol", "keep_alive": "1h"})
    expires = {m["name"]: m["expires_at"] for m in http.get("/api/ps").json()["models"]}
    assert expires["tiny-a"].startswith("9999") and not expires["smol"].startswith("9999")
    bad = http.post("/api/generate", json={"model": "smol", "keep_alive": "soon"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_max_loaded_models_unloads_the_least_recently_used_idle_one(http: httpx.Client, reference) -> None:
    for name in ("tiny-a", "smol"):  # tiny-a used before smol: tiny-a is the least recently used
        assert http.post("/models/load", json={"model": name}).json()["success"] is True
    assert _loaded(http) == {"tiny-a", "smol"}
    assert _complete(http, "tiny-b").json()["choices"][0]["text"] == reference["tiny-b"]
    assert _loaded(http) == {"smol", "tiny-b"}
    status = _status(http)
    assert (status["tiny-a"], status["tiny-b"], status["smol"]) == ("unloaded", "loaded", "loaded")
    assert http.post("/models/unload", json={"model": "tiny-b"}).json()["success"] is True
    assert _loaded(http) == {"smol"}


def test_metrics_carry_the_model_name(http: httpx.Client) -> None:
    assert _complete(http, "tiny-a").status_code == 200
    text = http.get("/metrics").text
    for name in ("smol", "tiny-a"):
        assert f'gpullama_generation_tokens_total{{model_name="{name}"}}' in text
        assert f'llamacpp:tokens_predicted_total{{model_name="{name}"}}' in text
        assert f'vllm:num_requests_running{{model_name="{name}"}}' in text
    assert 'gpullama_http_requests_total{route="/v1/completions",status="200"}' in text
