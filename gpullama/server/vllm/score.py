"""``POST /v1/score`` (and ``/score``): vLLM's score API for a reranker. The body: ``text_1`` (the query: a string,
or a list) and ``text_2`` (a string or a list), paired as vLLM pairs them (one ``text_1`` against each ``text_2``,
or the i-th with the i-th of two lists of one length); the answer ``{"id", "object": "list", "created", "model",
"data": [{"index", "object": "score", "score"}], "usage"}`` in pair order. Each pair is prompted as ``/rerank``
prompts a (query, document) pair (`gpullama.rerank`), so a Qwen3 reranker's score is its probability of "yes"."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.rerank import score_pairs

from ..http.body import JSONResponse, parse_json
from ..http.errors import FieldNames
from ..http.fields import bad, object_body, str_field
from ..http.streaming import ClientDisconnected
from ..openai.choices import new_id, now
from ..pipeline.intake import read_and_prepare
from ..pipeline.rerank import check_reranker, pair_prompts, run_scores, texts
from ..state import check_model

NAMES = FieldNames(fields=(("prompt", "text_2"),))
"""The engine's prompt is a pair's, named by its ``text_2``."""


def _prepare(state: Any, raw: bytes) -> list[list[int]]:
    body = object_body(parse_json(raw))
    check_model(state, str_field(body, "model"))
    check_reranker(state)
    text_1, text_2 = texts(body.get("text_1"), "text_1"), texts(body.get("text_2"), "text_2")
    try:
        pairs = score_pairs(text_1, text_2)
    except ValueError as exc:
        raise bad("text_2", str(exc)) from None
    def name(field: str, i: int) -> str:
        return f"{field}[{i}]" if isinstance(body[field], list) else field

    queries = [name("text_1", i if len(text_1) > 1 else 0) for i in range(len(pairs))]
    return pair_prompts(state, pairs, queries, [name("text_2", i) for i in range(len(pairs))])


async def score(request: Request) -> Response:
    """``POST /v1/score``."""
    request.state.field_names = NAMES
    arrival, state, prompts = await read_and_prepare(request, _prepare)
    try:
        done = await run_scores(request, state, prompts, new_id("score"), arrival)
    except ClientDisconnected:
        done = None
    if done is None:
        return Response(status_code=499)
    scores, num_tokens = done
    return JSONResponse({
        "id": new_id("score"), "object": "list", "created": now(), "model": state.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    })
