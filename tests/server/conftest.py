"""Real ``gpullama-serve`` processes: one (default model, API key on) shared by every server test of the session,
and one with small limits (queue, timeouts, connections, CORS) for the limit tests, which ends with a SIGTERM."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.helpers import API_KEY

# Prompts (token ids) whose sampling is made to raise inside the engine thread: the batched sampling of any step
# that carries them fails for every row, as a poison value in a batched tensor would. FAULT_PROMPT fails at its
# first token, LATE_FAULT_PROMPT once it has generated 3 tokens (mid-stream). They check that a generation
# failure fails that request alone (500, or an error event then [DONE]) while the rest of the batch goes on. Only
# this launcher installs the fault; the server code is the shipped one.
FAULT_PROMPT = [17, 17, 17, 17, 17, 17, 17, 42]
LATE_FAULT_PROMPT = [17, 17, 17, 17, 17, 17, 17, 43]
_LAUNCHER = f"""
import sys
import gpullama.engine.llm_engine as llm_engine
_sample_batch = llm_engine.sample_batch
def sample_batch(logits, seqs, ops):
    for seq in seqs:
        if seq.prompt_token_ids == {FAULT_PROMPT!r} or (
                seq.prompt_token_ids == {LATE_FAULT_PROMPT!r} and seq.num_output_tokens >= 3):
            raise RuntimeError("injected fault for the server's isolation tests")
    return _sample_batch(logits, seqs, ops)
llm_engine.sample_batch = sample_batch
from gpullama.server.cli import main
sys.exit(main(sys.argv[1:]))
"""
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command() -> list[str]:
    """The installed ``gpullama-serve`` console script, else ``python -m gpullama.server``."""
    script = Path(sys.executable).with_name("gpullama-serve")
    if script.is_file():
        return [str(script)]
    found = shutil.which("gpullama-serve")
    return [found] if found else [sys.executable, "-m", "gpullama.server"]


@dataclass
class Server:
    """A running server: its base URL, log file and what it answered while the model was loading."""

    base_url: str
    log_path: Path
    process: subprocess.Popen
    loading_answers: list[tuple[str, int, dict]] = field(default_factory=list)

    def log(self) -> str:
        """The server's log so far."""
        return self.log_path.read_text(errors="replace")


def start_server(model_path: Path | None, log_path: Path, extra_args: list[str] = ()) -> Server:
    """Start a server on a free port; poll /health (recording the 503s while loading) until it is ready."""
    port = free_port()
    # float32: bfloat16 matmuls round differently with the batch's shape, so a near-tied greedy token can flip
    # between a request served alone and the same request in a batch of 8 (seen in the library itself, not only
    # here); the server tests check that concurrent requests do not interfere, which needs batch-invariant numbers.
    args = ["--model", str(model_path)] if model_path is not None else []  # None: `extra_args` name the models
    args += ["--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY, "--dtype", "float32", *extra_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", _LAUNCHER, *args], stdout=log, stderr=subprocess.STDOUT,
                                   env=env, cwd=repo)
    srv = Server(f"http://127.0.0.1:{port}", log_path, process)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(base_url=srv.base_url, timeout=10) as http:
        while True:
            if process.poll() is not None:
                pytest.fail(f"gpullama-serve exited with {process.returncode} during start-up:\n{srv.log()[-4000:]}")
            if time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"gpullama-serve not ready after {STARTUP_TIMEOUT_S}s:\n{srv.log()[-4000:]}")
            try:
                health = http.get("/health")
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if health.status_code == 200:
                break
            srv.loading_answers.append(("/health", health.status_code, health.json()))
            if len(srv.loading_answers) < 3:
                models = http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
                srv.loading_answers.append(("/v1/models", models.status_code, models.json()))
            time.sleep(0.25)
    return srv


def stop_server(srv: Server) -> None:
    """Terminate a server (if still running) and wait for it."""
    process = srv.process
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """The shared server: default limits, API key on."""
    srv = start_server(default_model_path, tmp_path_factory.mktemp("server") / "server.log",
                       ["--log-stats-interval", "1"])
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def http(server: Server) -> httpx.Client:
    """An httpx client for raw requests, with the API key."""
    with httpx.Client(base_url=server.base_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    """The official OpenAI client pointed at the server."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(http: httpx.Client) -> str:
    """The served model's id from /v1/models."""
    return http.get("/v1/models").json()["data"][0]["id"]


