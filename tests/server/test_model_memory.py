"""``--max-model-memory`` (issue 36): the bytes the loaded models hold together. Each tiny model's size is counted
here from its file with gguf's reader (float32 weights, the KV pool the engine's rules reserve); the server's
`/api/ps` sizes, `LLM.memory_bytes` and the estimate from the header agree with it. With room for two tiny models,
loading a third unloads the least recently used idle one; a model that cannot fit even alone fails its own requests
with a clear error while the others go on answering."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

from gpullama import LLM, SamplingParams
from gpullama.engine.args import EngineArgs
from gpullama.engine.model_spec import estimate_memory_bytes
from tests.fixtures.tiny_models import build_tiny_model
from tests.server.conftest import start_server, stop_server
from tests.server.helpers import API_KEY

PROMPT = "The capital of France is"
TOKENS = 6
MAX_NUM_SEQS = 64  # the engine's default
BLOCK_SIZE = 16  # the engine's default
SLACK = 64 * 1024  # rope tables and step buffers, which the count below leaves out


def reference_bytes(path: Path) -> int:
    """A tiny float32 model's bytes counted from its file: every tensor as float32, and the default KV pool (on the
    CPU: `MAX_NUM_SEQS` full-length sequences, capped at 1 GiB) of float32 k and v rows plus one scratch block."""
    reader = gguf.GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def value(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    weights = sum(int(np.prod(t.shape)) for t in reader.tensors) * 4
    head_dim = value("embedding_length") // value("attention.head_count")
    per_block = 2 * value("block_count") * BLOCK_SIZE * value("attention.head_count_kv") * head_dim * 4
    blocks = min(MAX_NUM_SEQS * math.ceil(value("context_length") / BLOCK_SIZE), (1 << 30) // per_block)
    return weights + (blocks + 1) * per_block


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three tiny llamas of the same size and one whose 2048-token context makes its KV pool 8 times larger."""
    folder = tmp_path_factory.mktemp("memory_models")
    found = {f"tiny-{c}": build_tiny_model("llama", folder, seed=s).path for s, c in enumerate("abc")}
    found["long"] = build_tiny_model("llama", folder / "long", seed=3, context_length=2048).path
    return found


@pytest.fixture(scope="module")
def sizes(files: dict[str, Path]) -> dict[str, int]:
    return {name: reference_bytes(path) for name, path in files.items()}


@pytest.fixture(scope="module")
def server(files: dict[str, Path], sizes: dict[str, int], tmp_path_factory: pytest.TempPathFactory):
    budget = int(2.5 * sizes["tiny-a"])  # two tiny models fit, three do not; "long" does not fit alone
    assert 2 * sizes["tiny-a"] + SLACK < budget < 3 * sizes["tiny-a"] < sizes["long"]
    models = [arg for name, path in files.items() for arg in ("--model", f"{name}={path}")]
    srv = start_server(None, tmp_path_factory.mktemp("memory") / "server.log",
                       [*models, "--max-model-memory", str(budget), "--keep-alive", "10m",
                        "--log-stats-interval", "0"])
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "temperature": 0,
                                              "max_tokens": TOKENS, "ignore_eos": True})


def _ps(http: httpx.Client) -> dict[str, int]:
    return {m["name"]: m["size"] for m in http.get("/api/ps").json()["models"]}


def test_memory_bytes_and_the_estimate_match_the_count_from_the_file(files, sizes) -> None:
    path = files["tiny-a"]
    args = EngineArgs(model=str(path), device="cpu", dtype="float32")
    assert estimate_memory_bytes(args, str(path)) == sizes["tiny-a"]
    llm = LLM.from_engine_args(args)
    assert sizes["tiny-a"] <= llm.memory_bytes <= sizes["tiny-a"] + SLACK
    long_args = EngineArgs(model=str(files["long"]), device="cpu", dtype="float32")
    assert estimate_memory_bytes(long_args, str(files["long"])) == sizes["long"]


def test_loading_past_the_budget_unloads_the_least_recently_used_idle_model(server, http, files, sizes) -> None:
    ps = _ps(http)
    assert list(ps) == ["tiny-a"]  # the default model, loaded at start
    assert sizes["tiny-a"] <= ps["tiny-a"] <= sizes["tiny-a"] + SLACK  # Ollama's ps: the bytes it holds loaded
    assert _complete(http, "tiny-b").status_code == 200
    assert set(_ps(http)) == {"tiny-a", "tiny-b"}  # two fit
    assert _complete(http, "tiny-a").status_code == 200  # tiny-b is now the least recently used
    answer = _complete(http, "tiny-c")
    assert set(_ps(http)) == {"tiny-a", "tiny-c"}
    assert "model tiny-b: unloaded to make room for tiny-c (--max-model-memory" in server.log()
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    want = LLM(str(files["tiny-c"]), device="cpu", dtype="float32").generate([PROMPT], params)[0].outputs[0].text
    assert answer.json()["model"] == "tiny-c" and answer.json()["choices"][0]["text"] == want


def test_a_model_that_cannot_fit_alone_fails_only_its_own_requests(http, sizes) -> None:
    loaded = set(_ps(http))
    for _ in range(2):
        failed = _complete(http, "long")
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == "model_too_large" and error["param"] == "model"
        assert "model 'long' cannot be loaded" in error["message"] and "--max-model-memory" in error["message"]
        assert f"{sizes['long'] / 2**20:.1f} MiB" in error["message"]
    assert set(_ps(http)) == loaded  # nothing was unloaded for it
    status = {c["id"]: c["status"] for c in http.get("/v1/models").json()["data"]}
    assert status["long"]["value"] == "unloaded" and status["long"]["failed"] is True
    assert "--max-model-memory" in status["long"]["error"]
    assert all(_complete(http, name).status_code == 200 for name in loaded)
    ollama = http.post("/api/generate", json={"model": "long", "prompt": PROMPT, "stream": False})
    assert ollama.status_code == 500 and "--max-model-memory" in ollama.json()["error"]


def test_a_bad_budget_is_refused_at_start(files) -> None:
    done = subprocess.run([sys.executable, "-m", "gpullama.server", "--model", str(files["tiny-a"]),
                           "--max-model-memory", "lots"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--max-model-memory" in done.stderr and "'LOTS'" in done.stderr


class _FakeLLM:
    """What the registry reads of a loaded model, with a size of our choosing."""

    def __init__(self, nbytes: int) -> None:
        self.memory_bytes = nbytes
        self.device = "cpu"
        self.max_model_len = 16


class _FakeEngine:
    is_alive = True

    def shutdown(self) -> None:
        pass


def test_the_registry_evicts_by_measured_bytes_and_waits_for_busy_models(tmp_path: Path) -> None:
    """The registry alone, on models whose files it cannot estimate (need 0 before the first load) and whose
    measured sizes are given: a load that turns out over budget unloads the least recently used idle model; one
    too large alone is dropped with model_too_large; once measured, a load waits while the only model it could
    unload is busy, and goes on when that one is let go."""
    import asyncio

    from gpullama.server.http.errors import APIError
    from gpullama.server.state import ServerConfig, ServerState

    sizes = {"a": 40, "b": 50, "huge": 200, "d": 60}
    paths = {name: str(tmp_path / f"{name}.gguf") for name in sizes}  # not there: no estimate before a load
    loader = (lambda config: (_FakeLLM(sizes[Path(config.engine.model).stem]), lambda llm: _FakeEngine()))
    config = ServerConfig(engine=EngineArgs(model=paths["a"]), models=list(paths.items()), max_model_memory=100,
                          log_stats_interval=0, keep_alive=-1.0)

    async def scenario() -> None:
        server = ServerState(config, loader, check_file=lambda model: None)  # no files: nothing to check
        m = server.models

        def loaded() -> set[str]:
            return {name for name, entry in m.items() if entry.status == "loaded"}

        await m["a"].ensure_loaded()
        await m["b"].ensure_loaded()
        assert loaded() == {"a", "b"}  # 90 of 100
        with pytest.raises(APIError) as too_large:
            await m["huge"].ensure_loaded()
        assert too_large.value.status == 500 and too_large.value.code == "model_too_large"
        assert "even alone" in too_large.value.message and m["huge"].status == "failed"
        assert loaded() == {"a", "b"}  # nothing stays unloaded for it
        m["a"].hold(None)
        m["a"].release()  # a used after b: b is the least recently used
        await m["d"].ensure_loaded()  # estimated 0, measured 60: 150 > 100, so b goes
        assert loaded() == {"a", "d"}
        m["d"].hold(None)  # busy: it cannot be unloaded
        waiting = asyncio.ensure_future(m["b"].ensure_loaded())  # measured 50 now: room is made before loading
        await asyncio.sleep(0.2)
        assert not waiting.done() and m["b"].status == "loading" and loaded() == {"d"}  # a went; d is busy
        m["d"].release()  # idle: unloaded to make room
        await asyncio.wait_for(waiting, 30)
        assert loaded() == {"b"}
        server.shutdown()

    asyncio.run(scenario())
