"""The `gpullama` command as a person meets it: chat at a terminal (through a pty), quick answers that load no model,
arguments checked before loading, Hugging Face references resolved from a pre-filled cache offline."""

from __future__ import annotations

import os
import platform
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_cli import assert_one_line_error, gpullama, info_rows

WAIT_S = 120
# The system calls a thread waiting for a key sleeps in (select, poll and their p-forms), by machine; glibc's select
# is pselect6 on most.
WAIT_FOR_INPUT_SYSCALLS = {"x86_64": {7, 23, 270, 271}, "aarch64": {72, 73}}.get(platform.machine(), set())


def waits_for_input(pid: int) -> bool | None:
    """Whether the process's main thread sleeps waiting for input (in select or poll): True, False, or None when
    this kernel shows neither where it sleeps nor which system call it is in."""
    with open(f"/proc/{pid}/wchan") as f:
        wchan = f.read()
    if "poll" in wchan or "select" in wchan:
        return True
    if wchan != "0":  # asleep somewhere else
        return False
    # "0": running, or a kernel that hides where tasks sleep; the system call it is in tells them apart
    try:
        with open(f"/proc/{pid}/syscall") as f:
            call = f.read().split()[0]
    except (OSError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return False if state == "R" else None
    return call != "running" and int(call) in WAIT_FOR_INPUT_SYSCALLS


class Terminal:
    """`python -m gpullama.cli ARGS` on a pseudo-terminal: what it printed so far, typing, Ctrl-C, Ctrl-D."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session leader whose controlling terminal is the pty
            # as a shell starts a foreground program: SIGINT at its default, whatever this process inherited (a
            # background job starts with it ignored, and Python then leaves Ctrl-C ignored in the child too)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(sys.executable, [sys.executable, "-m", "gpullama.cli", *args], {**os.environ, **(env or {})})
        self.output = ""

    def _read_until_seen(self, seen: Callable[[], bool], what: str, timeout: float) -> None:
        """Read the child's output until `seen()` holds."""
        deadline = time.monotonic() + timeout
        while not seen():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{what} not seen in {timeout}s; output so far:\n{self.output[-3000:]}")
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"{what} not seen before exit; output:\n{self.output[-3000:]}")
                self.output += chunk.decode(errors="replace")

    def read_until(self, needle: str, timeout: float = WAIT_S) -> str:
        """Read until `needle` appears after what was already consumed; returns the text up to and including it."""
        self._read_until_seen(lambda: needle in self.output, repr(needle), timeout)
        head, _, rest = self.output.partition(needle)
        self.output = rest
        return head + needle

    def read_some_text(self, timeout: float = WAIT_S) -> None:
        """Read until some text (not only line breaks or blanks) follows what was already consumed; it stays
        unconsumed."""
        self._read_until_seen(lambda: bool(self.output.strip()), "text", timeout)

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def settle_at_prompt(self, timeout: float = WAIT_S) -> None:
        """Wait until the child's main thread sleeps waiting for input, as it is by the time a person types. Seeing the
        prompt is not enough for a Ctrl-C: readline writes it with SIGINT blocked, and a signal that arrives then
        reaches the main thread only after it has gone back to waiting for a key (CPython's readline loop waits with
        no timeout), so the key typed at once would be lost."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            waiting = waits_for_input(self.pid)
            if waiting:
                return
            if waiting is None:  # a kernel that hides where tasks sleep: give it what a person's reaction takes
                time.sleep(0.5)
                return
            time.sleep(0.01)
        raise AssertionError(f"not waiting for input after {timeout}s; output:\n{self.output[-3000:]}")

    def wait(self, timeout: float = WAIT_S) -> int:
        """The exit status once the process ends (draining its output meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    self.output += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:
                    pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"still running after {timeout}s; output:\n{self.output[-3000:]}")


def test_chat_at_a_terminal(default_model_path: Path) -> None:
    """Loading is shown at once; slash commands stay local; Ctrl-C stops an answer and keeps the conversation;
    Ctrl-D leaves with a newline and status 0."""
    term = Terminal("chat", "--model", str(default_model_path), "--device", "cpu", "--dtype", "float32",
                    "--max-tokens", "400", "--ignore-eos")
    term.read_until("loading ")
    term.read_until("/help for commands")
    term.read_until("> ")
    term.type("/help\n")
    assert "/reset" in term.read_until("> ")
    term.type("/system Answer in one word.\n")
    assert "system prompt set" in term.read_until("> ")
    term.type("Tell me a long story about a lighthouse keeper.\n")
    term.read_until("Tell me a long story about a lighthouse keeper.")  # the echo of the typed line
    term.read_some_text()  # the answer has begun: some of the 400 tokens are out, far from all
    term.type("\x03")
    assert "[stopped]" in term.read_until("> ")
    term.type("/nonsense\n")
    assert "unknown command /nonsense" in term.read_until("> ")
    term.type("\x04")
    assert term.wait() == 0


def test_chat_says_when_max_tokens_cut_the_answer(tiny_model) -> None:
    term = Terminal("chat", "--model", str(tiny_model("llama", "F32").path), "--device", "cpu", "--max-tokens", "3",
                    "--ignore-eos")
    term.read_until("> ")
    term.type("hello\n")
    assert "[cut at --max-tokens 3" in term.read_until("> ")
    term.type("/exit\n")
    assert term.wait() == 0


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S,
                          env={**os.environ, **(env or {})})


NO_TORCH = "import sys; from gpullama.cli import main; code = main({argv!r}); print('torch' in sys.modules, code)"


def test_help_version_info_and_list_load_no_torch(default_model_path: Path) -> None:
    for argv in (["info", str(default_model_path)], ["list"], ["--version"]):
        result = run_python(NO_TORCH.format(argv=argv) if argv != ["--version"] else
                            "import sys\ntry:\n from gpullama.cli import main; main(['--version'])\n"
                            "except SystemExit: print('torch' in sys.modules)")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[-1].split()[0] == "False", (argv, result.stdout)
    help_ = run_python("import sys\nfrom gpullama.server.cli import parse_args\ntry: parse_args(['--help'])\n"
                       "except SystemExit: print('torch' in sys.modules)")
    assert help_.stdout.strip().splitlines()[-1] == "False"
    assert "--max-num-seqs" in help_.stdout and "--api-key" in help_.stdout


def test_arguments_are_checked_before_the_model_loads(default_model_path: Path) -> None:
    result = run_python(NO_TORCH.format(argv=["generate", "--model", str(default_model_path), "--prompt", "x",
                                              "--max-model-len", "64", "--max-tokens", "64"]))
    assert result.stdout.split() == ["False", "2"], result.stdout
    assert "--max-tokens 64" in result.stderr and "--max-model-len 64" in result.stderr
    assert_one_line_error(gpullama("generate", "--prompt", "x", "--model", "no-such-model"), "no-such-model",
                          "smollm2-135m")
    assert_one_line_error(gpullama("chat", "--device", "tpu"), "device")
    bad_port = subprocess.run([sys.executable, "-m", "gpullama.cli", "serve", "--port", "99999"], capture_output=True,
                              text=True, timeout=WAIT_S)
    assert bad_port.returncode == 2 and "Traceback" not in bad_port.stderr and "port" in bad_port.stderr


def test_generate_takes_the_library_sampling_flags(default_model_path: Path) -> None:
    result = gpullama("generate", "--model", str(default_model_path), "--prompt", "The capital of France is",
                      "--max-tokens", "8", "--stop", "Paris", "--min-p", "0.05", "--repetition-penalty", "1.1",
                      "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert ", 1 threads)" in result.stderr  # the load log line: --threads reached torch
    assert "Paris" not in result.stdout  # stopped before it
    chat_like = gpullama("generate", "--model", str(default_model_path), "--system", "Answer with one word.",
                         "--prompt", "What is the capital of France?", "--max-tokens", "8")
    assert chat_like.returncode == 0 and "Paris" in chat_like.stdout, chat_like.stdout


@pytest.fixture
def hf_cache(tmp_path: Path, default_model_path: Path) -> Path:
    """A Hugging Face hub cache holding one GGUF repo, laid out as huggingface_hub writes it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--SmolLM2-135M-Instruct-GGUF"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(default_model_path)
    return tmp_path / "hub"


def test_hugging_face_references_resolve_from_the_cache_offline(hf_cache: Path, tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1", "GPULLAMA_HOME": str(tmp_path / "empty")}
    want = hf_cache / "models--someone--SmolLM2-135M-Instruct-GGUF" / "snapshots"
    for ref in ("hf://someone/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf",
                "someone/SmolLM2-135M-Instruct-GGUF:q4_1", "someone/SmolLM2-135M-Instruct-GGUF:Q4_1"):
        result = gpullama("info", ref, env=env)
        assert result.returncode == 0, (ref, result.stderr)
        rows = info_rows(result.stdout)
        assert rows["file"].startswith(str(want)) and rows["architecture"] == "llama", rows
    listed = gpullama("list", env=env)
    assert "hf://someone/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf" in listed.stdout
    assert_one_line_error(gpullama("info", "someone/SmolLM2-135M-Instruct-GGUF:Q8_0", env=env), "Q8_0")
    assert_one_line_error(gpullama("info", "hf://nobody/nothing/x.gguf", env=env), "nobody/nothing", "cache")


def test_loading_shows_each_step_at_a_terminal_and_ctrl_c_at_the_prompt_leaves(tiny_model) -> None:
    term = Terminal("chat", "--model", str(tiny_model("llama", "F32").path), "--device", "cpu", "--threads", "1")
    shown = term.read_until("> ")
    for step in ("loading ", "reading ", "preparing 2 layers of weights", "reserving the KV cache", "loaded "):
        assert step in shown, (step, shown)
    assert shown.index("reading ") < shown.index("preparing ") < shown.index("reserving ") < shown.index("loaded ")
    term.settle_at_prompt()
    term.type("\x03")  # Ctrl-C at an empty prompt: leave, with a newline, status 0
    assert term.wait() == 0
    assert term.output.startswith("\r\n") or term.output.startswith("^C\r\n"), repr(term.output)
