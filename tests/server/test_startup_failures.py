"""How `gpullama-serve` fails to start: a bad model reference before the port is bound, a model whose load fails,
a port in use; each with one clear last line and the documented exit status (docs/server.md, "Exit status")."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import free_port, serve_command

BAD_INPUT, CANNOT_BIND = 2, 3


@pytest.fixture()
def taken_port() -> Iterator[int]:
    """A loopback port held open by this test, so that a server that tries to bind it fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*serve_command(), "--host", "127.0.0.1", *args], capture_output=True, text=True,
                          timeout=timeout)


def last_line(run: subprocess.CompletedProcess) -> str:
    return run.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("reference, reason", [
    ("nosuch", "unknown model 'nosuch'"),
    ("/nonexistent/model.gguf", "model file not found: /nonexistent/model.gguf"),
    (__file__, "is not a GGUF file"),
])
def test_a_bad_model_reference_fails_before_the_port_is_bound(reference, reason, taken_port) -> None:
    """Checked before binding: with the port taken, a server that bound first would fail on the port instead."""
    run = serve("--model", reference, "--port", str(taken_port))
    assert run.returncode == BAD_INPUT, run.stderr
    assert run.stderr.strip().splitlines() == [last_line(run)], run.stderr  # one line, no uvicorn log
    assert last_line(run).startswith("gpullama-serve: error: ") and reason in last_line(run)
    assert "Traceback" not in run.stderr and run.stdout == ""


def test_a_missing_chat_template_file_fails_before_the_port_is_bound(tiny_model, taken_port) -> None:
    run = serve("--model", str(tiny_model("llama").path), "--chat-template-file", "/nonexistent/chat.jinja",
                "--port", str(taken_port))
    assert run.returncode == BAD_INPUT, run.stderr
    assert run.stderr.strip().splitlines() == [last_line(run)], run.stderr
    assert "chat_template: cannot read the template file '/nonexistent/chat.jinja'" in last_line(run)


def test_a_truncated_model_file_fails_before_the_port_is_bound(tiny_model, tmp_path: Path, taken_port) -> None:
    data = tiny_model("llama").path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])  # the header parses; the last tensor's data is short
    run = serve("--model", str(cut), "--port", str(taken_port))
    assert run.returncode == BAD_INPUT, run.stderr
    assert run.stderr.strip().splitlines() == [last_line(run)], run.stderr
    assert "truncated GGUF file" in last_line(run) and "cut.gguf" in last_line(run)


def test_a_load_that_fails_ends_with_the_reason_as_the_last_line(tiny_model) -> None:
    """A KV cache too small for one sequence fails only once the model is loaded, after the port was bound."""
    run = serve("--model", str(tiny_model("llama").path), "--port", str(free_port()), "--kv-cache-memory", "1K")
    assert run.returncode == BAD_INPUT, run.stderr
    assert "Uvicorn running" in run.stderr  # it did bind first
    line = last_line(run)
    assert line.startswith(f"gpullama-serve: error: cannot load model {tiny_model('llama').path}: "), run.stderr
    assert "KV" in line and "Traceback" not in run.stderr


def test_a_port_in_use_exits_3_naming_the_address(tiny_model, taken_port) -> None:
    run = serve("--model", str(tiny_model("llama").path), "--port", str(taken_port))
    assert run.returncode == CANNOT_BIND, run.stderr
    line = last_line(run)
    assert line.startswith(f"gpullama-serve: error: cannot listen on 127.0.0.1:{taken_port}: "), run.stderr
    assert "address already in use" in line
