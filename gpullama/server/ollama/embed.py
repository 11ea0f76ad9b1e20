"""``POST /api/embed`` (``{"input": str | [str]}`` -> ``{"embeddings": [[...]]}``) and the older
``POST /api/embeddings`` (``{"prompt": str}`` -> ``{"embedding": [...]}``), on the engine's embedding requests."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from ..http.body import JSONResponse
from ..http.errors import FieldNames
from ..http.fields import bad, int_field, kind, object_body
from ..http.streaming import ClientDisconnected
from ..pipeline.embedding import one_vector_pooling, run_embeddings
from ..pipeline.intake import read_json_for_model
from ..registry import ModelState, answer_name
from .request import check_model_name

NAMES = FieldNames(fields=(("prompt", "input"),))
LEGACY_NAMES = FieldNames(fields=(("prompt", "prompt"),))


async def _embed(request: Request, state: ModelState, texts: list[str],
                 dimensions: int | None) -> tuple[list[list[float]], int] | None:
    ids = [state.llm.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    pooling = one_vector_pooling(state, dimensions)
    try:
        return await run_embeddings(request, state, ids, pooling, f"embed-{uuid.uuid4().hex}")
    except ClientDisconnected:
        return None


async def embed(request: Request) -> Response:
    """``POST /api/embed``."""
    arrival = time.perf_counter()
    request.state.field_names = NAMES
    state, body = await read_json_for_model(request)
    body = object_body(body)
    check_model_name(state, body.get("model"))
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad("input", f"'input' must be a non-empty string or a non-empty list of them, got {kind(value)}")
    done = await _embed(request, state, texts, int_field(body, "dimensions"))
    if done is None:
        return Response(status_code=499)
    vectors, prompt_tokens = done
    return JSONResponse({"model": answer_name(request, state), "embeddings": vectors,
                         "total_duration": int((time.perf_counter() - arrival) * 1e9), "load_duration": 0,
                         "prompt_eval_count": prompt_tokens})


async def embeddings(request: Request) -> Response:
    """``POST /api/embeddings`` (Ollama's older endpoint): one prompt, one vector."""
    request.state.field_names = LEGACY_NAMES
    state, body = await read_json_for_model(request)
    body = object_body(body)
    check_model_name(state, body.get("model"))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", f"'prompt' must be a non-empty string, got {kind(prompt)}")
    done = await _embed(request, state, [prompt], None)
    if done is None:
        return Response(status_code=499)
    return JSONResponse({"embedding": done[0][0]})
