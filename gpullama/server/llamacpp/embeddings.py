"""``POST /embeddings`` and ``POST /embedding``: llama.cpp's native embeddings. The body is ``/v1/embeddings``' (an
``input``, or llama.cpp's ``content``, in its prompt shapes: `gpullama.server.pipeline.prompts`), the answer
``[{"index", "embedding": [[...]]}]``: one row per input, pooled as ``--pooling`` (else the model) says and
normalised as ``embd_normalize`` says (default 2, Euclidean); with ``--pooling none``, one row per token, as computed
(never normalised)."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.pooling_params import PoolingParams

from ..http.body import JSONResponse, parse_json
from ..http.errors import FieldNames
from ..http.fields import bad, int_field, object_body, str_field
from ..http.streaming import ClientDisconnected
from ..pipeline.embedding import ENCODINGS, parse_inputs, run_embeddings, tokenize_inputs
from ..pipeline.intake import read_and_prepare
from ..state import ServerState, check_model

NAMES = FieldNames(fields=(("prompt", "input"),))
CONTENT_NAMES = FieldNames(fields=(("prompt", "content"),))
"""The input's name in errors: ``input``, or ``content`` when the body gives that instead."""


def normalized(vector: list[float], norm: int) -> list[float]:
    """llama.cpp's ``embd_normalize``: -1 none, 0 the largest magnitude scaled to 32760 (int16's range), 1 taxicab,
    2 Euclidean, p > 2 the p-norm."""
    if norm < 0:
        return vector
    if norm == 0:
        scale = max((abs(v) for v in vector), default=0.0) / 32760.0
    elif norm == 2:
        scale = sum(v * v for v in vector) ** 0.5
    else:
        scale = sum(abs(v) ** norm for v in vector) ** (1.0 / norm)
    return [v / scale for v in vector] if scale > 0 else [0.0 for _ in vector]


def _prepare(request: Request, state: ServerState, raw: bytes) -> tuple[list[list[int]], int]:
    body = object_body(parse_json(raw))
    check_model(state, str_field(body, "model"))
    name = "input" if body.get("input") is not None or body.get("content") is None else "content"
    request.state.field_names = NAMES if name == "input" else CONTENT_NAMES
    inputs = parse_inputs(body.get(name), name, mixed=True)
    encoding = str_field(body, "encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad("encoding_format", f"'encoding_format' must be one of {list(ENCODINGS)}, got {encoding[:40]!r}")
    norm = int_field(body, "embd_normalize")
    return tokenize_inputs(state.llm.tokenizer, inputs), 2 if norm is None else norm


async def embeddings(request: Request) -> Response:
    """``POST /embeddings`` (and the older ``POST /embedding``)."""
    request.state.field_names = NAMES
    arrival, state, (ids, norm) = await read_and_prepare(request, _prepare, request)
    pooling = state.config.pooling
    try:
        done = await run_embeddings(request, state, ids, PoolingParams(normalize=False, kind=pooling),
                                    f"embd-{uuid.uuid4().hex}", arrival)
    except ClientDisconnected:
        done = None
    if done is None:
        return Response(status_code=499)
    vectors: list[Any] = done[0]
    rows = [v if pooling == "none" else [normalized(v, norm)] for v in vectors]
    return JSONResponse([{"index": i, "embedding": r} for i, r in enumerate(rows)])
