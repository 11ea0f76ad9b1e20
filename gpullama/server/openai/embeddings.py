"""``POST /v1/embeddings``: OpenAI's embeddings (what ``client.embeddings.create``, langchain's OpenAIEmbeddings and
litellm call): one vector per input, pooled as the model says, L2-normalised; ``float`` or ``base64``."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ..http.body import JSONResponse, parse_json
from ..http.errors import FieldNames
from ..http.fields import bad, int_field, object_body, str_field
from ..http.streaming import ClientDisconnected
from ..pipeline.embedding import ENCODINGS, one_vector_pooling, parse_inputs, run_embeddings, tokenize_inputs
from ..pipeline.intake import read_and_prepare
from ..pipeline.prompts import Pieces
from ..registry import answer_name
from ..state import ServerState, check_model
from .choices import new_id

NAMES = FieldNames(fields=(("prompt", "input"),))
"""The embeddings API's names for the engine's fields (the prompt is the input)."""


@dataclass
class EmbeddingRequest:
    """A validated ``POST /v1/embeddings`` body; each input is a string or a list of token ids."""

    model: str | None
    inputs: list[Pieces]
    encoding_format: str
    dimensions: int | None


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
        done = await run_embeddings(request, state, ids, one_vector_pooling(state, req.dimensions), new_id("embd"),
                                    arrival)
    except ClientDisconnected:
        done = None
    if done is None:
        return Response(status_code=499)
    vectors, prompt_tokens = done
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": answer_name(request, state),
                         "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
