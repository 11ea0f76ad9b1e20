"""Ollama's model listings: ``GET /api/tags`` (the served model), ``POST /api/show`` (its details, template and
metadata), ``GET /api/ps`` (it is loaded), ``GET /api/version``, and ``GET /`` (the "is Ollama running" probe that
apps make)."""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gpullama import __version__

from ..http.body import JSONResponse
from ..http.fields import object_body
from ..pipeline.intake import read_json
from ..state import ServerState, require_ready, server_state
from .request import check_model_name


def _details(state: ServerState) -> dict[str, Any]:
    llm = state.llm
    file_type = llm.metadata.get("general.file_type")
    return {"parent_model": "", "format": "gguf", "family": llm.config.architecture,
            "families": [llm.config.architecture], "parameter_size": _parameter_size(llm.metadata),
            "quantization_level": _FILE_TYPES.get(file_type, str(file_type) if file_type is not None else "")}


_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               32: "BF16"}


def _parameter_size(metadata: dict[str, Any]) -> str:
    label = metadata.get("general.size_label")
    return label if isinstance(label, str) else ""


def _file(state: ServerState) -> tuple[int, str, str]:
    """(size in bytes, a digest of the path and size, the file's modification time)."""
    path = str(state.llm.path)
    try:
        stat = os.stat(path)
        size, mtime = stat.st_size, stat.st_mtime
    except OSError:
        size, mtime = 0, 0.0
    digest = hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()
    modified = datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    return size, digest, modified


async def tags(request: Request) -> Response:
    """``GET /api/tags``: the one served model."""
    state = server_state(request)
    require_ready(state)
    size, digest, modified = _file(state)
    return JSONResponse({"models": [{"name": state.model_name, "model": state.model_name, "modified_at": modified,
                                     "size": size, "digest": digest, "details": _details(state)}]})


async def ps(request: Request) -> Response:
    """``GET /api/ps``: the served model, loaded."""
    state = server_state(request)
    require_ready(state)
    size, digest, _ = _file(state)
    return JSONResponse({"models": [{"name": state.model_name, "model": state.model_name, "size": size,
                                     "digest": digest, "details": _details(state),
                                     "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                                     "context_length": state.llm.max_model_len}]})


async def show(request: Request) -> Response:
    """``POST /api/show``: the model's details, chat template, parameters, metadata and capabilities."""
    state = server_state(request)
    require_ready(state)
    body = object_body(await read_json(request))
    check_model_name(state, body.get("model", body.get("name")))
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
