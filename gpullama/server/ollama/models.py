"""Ollama's model listings: ``GET /api/tags`` (the served models), ``POST /api/show`` (one's details, template and
metadata), ``GET /api/ps`` (the loaded ones, until when), ``GET /api/version``, and ``GET /`` (the "is Ollama running" probe that
apps make)."""

from __future__ import annotations

import hashlib
import os
import time
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gpullama import __version__
from gpullama.gguf_file import read_header
from gpullama.hub import resolve_model

from ..http.body import JSONResponse
from ..http.fields import object_body
from ..pipeline.intake import read_json
from ..registry import FOREVER, ModelState, use_model
from ..state import require_ready, server_state
from .request import check_model_name


def _metadata(entry: ModelState) -> dict[str, Any]:
    """The model's GGUF metadata: the loaded model's, else read from the file's header (no load)."""
    if entry.llm is not None:
        return entry.llm.metadata
    try:
        return read_header(resolve_model(entry.path, download=False)).metadata
    except (OSError, ValueError):
        return {}


def _details(entry: ModelState) -> dict[str, Any]:
    metadata = _metadata(entry)
    architecture = entry.llm.config.architecture if entry.llm is not None else metadata.get("general.architecture", "")
    file_type = metadata.get("general.file_type")
    return {"parent_model": "", "format": "gguf", "family": architecture, "families": [architecture],
            "parameter_size": _parameter_size(metadata),
            "quantization_level": _FILE_TYPES.get(file_type, str(file_type) if file_type is not None else "")}


_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               32: "BF16"}


def _parameter_size(metadata: dict[str, Any]) -> str:
    label = metadata.get("general.size_label")
    return label if isinstance(label, str) else ""


def _file(entry: ModelState) -> tuple[int, str, str]:
    """(size in bytes, a digest of the path and size, the file's modification time)."""
    path = str(entry.llm.path) if entry.llm is not None else resolve_model(entry.path, download=False)
    try:
        stat = os.stat(path)
        size, mtime = stat.st_size, stat.st_mtime
    except OSError:
        size, mtime = 0, 0.0
    digest = hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()
    modified = datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    return size, digest, modified


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def expires_at(entry: ModelState) -> str:
    """Ollama's ``expires_at`` of a loaded model: when its keep-alive runs out (counted from now while a request
    holds it); a model kept forever, the far future."""
    if entry.keep_alive == FOREVER:
        return "9999-12-31T23:59:59Z"
    return _iso(entry.expires_at if entry.expires_at is not None else time.time() + entry.keep_alive)


async def tags(request: Request) -> Response:
    """``GET /api/tags``: every served model, loaded or not."""
    state = server_state(request)
    require_ready(state)
    models = []
    for entry in state.models.values():
        size, digest, modified = _file(entry)
        models.append({"name": entry.model_name, "model": entry.model_name, "modified_at": modified, "size": size,
                       "digest": digest, "details": _details(entry)})
    return JSONResponse({"models": models})


async def ps(request: Request) -> Response:
    """``GET /api/ps``: the loaded models, each with the bytes it holds and when its keep-alive runs out."""
    state = server_state(request)
    require_ready(state)
    models = []
    for entry in state.models.values():
        if entry.status != "loaded":
            continue
        _, digest, _ = _file(entry)
        size = entry.memory_bytes or 0  # what it holds loaded (weights, KV pool, state), as Ollama's ps says
        on_gpu = getattr(entry.llm.device, "type", "cpu") == "cuda"
        models.append({"name": entry.model_name, "model": entry.model_name, "size": size, "digest": digest,
                       "details": _details(entry), "expires_at": expires_at(entry), "size_vram": size if on_gpu else 0,
                       "context_length": entry.llm.max_model_len})
    return JSONResponse({"models": models})


async def show(request: Request) -> Response:
    """``POST /api/show``: the model's details, chat template, parameters, metadata and capabilities (it loads
    the model when it is not loaded)."""
    require_ready(server_state(request))
    body = object_body(await read_json(request))
    name = body.get("model", body.get("name"))
    state = await use_model(request, name)
    check_model_name(state, name)
    llm = state.llm
    info = {k: v for k, v in llm.metadata.items() if not k.startswith("tokenizer.") and isinstance(v, (int, float, str))}
    template = llm.tokenizer.chat_template.source or ""
    capabilities = ["completion", "embedding"] + (["tools"] if "tools" in template else [])
    if "</think>" in template:
        capabilities.append("thinking")
    if getattr(state.llm, "vision", None) is not None:
        capabilities.append("vision")
    _, _, modified = _file(state)
    return JSONResponse({"modelfile": f"FROM {llm.path}\n", "parameters": f"num_ctx {llm.max_model_len}",
                         "template": template, "details": _details(state), "model_info": info,
                         "capabilities": capabilities, "modified_at": modified})


async def version(request: Request) -> Response:
    """``GET /api/version``: gpullama's version."""
    return JSONResponse({"version": __version__})


async def root(request: Request) -> Response:
    """``GET /``: the plain-text answer apps probe for ("Ollama is running")."""
    return PlainTextResponse("Ollama is running")
