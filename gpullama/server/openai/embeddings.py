"""``POST /v1/embeddings``: OpenAI's embeddings (what ``client.embeddings.create``, langchain's OpenAIEmbeddings and
litellm call): one vector per input, pooled as the model says, L2-normalised; ``float`` or ``base64``."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from gpullama.pooling_params import PoolingParams

from ..http.body import JSONResponse, parse_json
from ..http.errors import FieldNames
from ..http.fields import bad, int_field, kind, object_body, str_field
from ..http.streaming import ClientDisconnected
from ..pipeline.embedding import run_embeddings
from ..pipeline.intake import read_and_prepare
from ..state import ServerState, check_model
from .choices import new_id

MAX_INPUTS = 2048  # inputs per request, as the OpenAI API allows
ENCODINGS = ("float", "base64")
NAMES = FieldNames(fields=(("prompt", "input"),))
"""The embeddings API's names for the engine's fields (the prompt is the input)."""


@dataclass
class EmbeddingRequest:
    """A validated ``POST /v1/embeddings`` body; each input is a string or a list of token ids."""

    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str
    dimensions: int | None


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def parse_inputs(value: Any, name: str = "input") -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of token-id lists: non-empty, at most
    `MAX_INPUTS` inputs, no empty string."""
    if value is None:
        raise bad(name, f"'{name}' is a required field")
    if isinstance(value, str) or _is_ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad(name, f"'{name}' must be a string, a list of strings, a list of token ids or a list of token-id "
                  f"lists (non-empty), got {kind(value)}")
    if len(value) > MAX_INPUTS:
        raise bad(name, f"'{name}' holds {len(value)} inputs; at most {MAX_INPUTS} are allowed")
    for i, item in enumerate(value):
        if not (isinstance(item, str) or _is_ids(item)):
            raise bad(f"{name}[{i}]", f"'{name}[{i}]' must be a string or a non-empty list of token ids, got "
                      f"{kind(item)}")
        if item == "":
            raise bad(f"{name}[{i}]", f"'{name}[{i}]' is an empty string")
    return value


def parse_embeddings(body: Any) -> EmbeddingRequest:
    """Validate an embeddings body; 400 naming the bad field."""
    body = object_body(body)
    model = str_field(body, "model")
    inputs = parse_inputs(body.get("input"))
    encoding = str_field(body, "encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad("encoding_format", f"'encoding_format' must be one of {list(ENCODINGS)}, got {encoding[:40]!r}")
    dimensions = int_field(body, "dimensions")
    return EmbeddingRequest(model, inputs, encoding, dimensions)


def tokenize_inputs(tokenizer: Any, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's token ids: a string tokenized as a completion prompt is (the model's BOS/EOS rules)."""
    return [tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p) for p in inputs]


def _prepare(state: ServerState, raw: bytes) -> tuple[EmbeddingRequest, list[list[int]]]:
    req = parse_embeddings(parse_json(raw))
    check_model(state, req.model)
    return req, tokenize_inputs(state.llm.tokenizer, req.inputs)


def encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or its little-endian float32 bytes in base64."""
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embeddings(request: Request) -> Response:
    """``POST /v1/embeddings``."""
    request.state.field_names = NAMES
    arrival, state, (req, ids) = await read_and_prepare(request, _prepare)
    try:
        done = await run_embeddings(request, state, ids, PoolingParams(dimensions=req.dimensions), new_id("embd"),
                                    arrival)
    except ClientDisconnected:
        done = None
    if done is None:
        return Response(status_code=499)
    vectors, prompt_tokens = done
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": state.model_name,
                         "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
