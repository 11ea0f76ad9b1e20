"""``POST /rerank`` (and ``/reranking``, ``/v1/rerank``, ``/v1/reranking``): llama.cpp's reranking, Jina's and
Cohere's shape. The body: ``query`` (a string), ``documents`` (strings, or ``{"text": ...}`` objects), ``top_n``
(default: every document), ``return_documents`` (default false); the answer ``{"model", "object": "list", "usage":
{"prompt_tokens", "total_tokens"}, "results": [{"index", "relevance_score"(, "document": {"text"})}]}``, best first.
With ``texts`` in place of ``documents`` (Hugging Face TEI's shape), the answer is the list ``[{"index", "score"(,
"text" with ``return_text``)}]``. Each document is scored on its own prompt (`gpullama.rerank`)."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..http.body import JSONResponse, parse_json
from ..http.errors import FieldNames
from ..http.fields import bad, bool_field, int_field, object_body, str_field
from ..http.streaming import ClientDisconnected
from ..pipeline.intake import read_and_prepare
from ..pipeline.rerank import check_reranker, pair_prompts, run_scores, texts
from ..state import check_model

NAMES = FieldNames(fields=(("prompt", "documents"),))
"""The engine's prompt is a document's."""


def _prepare(state: Any, raw: bytes) -> tuple[dict, list[str], list[list[int]]]:
    body = object_body(parse_json(raw))
    check_model(state, str_field(body, "model"))
    check_reranker(state)
    if not isinstance(body.get("query"), str):
        raise bad("query", "'query' must be a string" if "query" in body else "'query' must be provided")
    name = "texts" if "texts" in body else "documents"
    documents = texts(body.get(name), name, objects=name == "documents")
    top_n = int_field(body, "top_n")
    if top_n is not None and top_n < 1:
        raise bad("top_n", f"'top_n' must be at least 1, got {top_n}")
    bool_field(body, "return_documents")
    bool_field(body, "return_text")
    names = [f"{name}[{i}]" for i in range(len(documents))]
    prompts = pair_prompts(state, [(body["query"], d) for d in documents], ["query"] * len(names), names)
    return body, documents, prompts


async def rerank(request: Request) -> Response:
    """``POST /rerank``."""
    request.state.field_names = NAMES
    arrival, state, (body, documents, prompts) = await read_and_prepare(request, _prepare)
    try:
        done = await run_scores(request, state, prompts, f"rerank-{uuid.uuid4().hex}", arrival)
    except ClientDisconnected:
        done = None
    if done is None:
        return Response(status_code=499)
    scores, num_tokens = done
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.get("top_n") or len(scores)]
    if "texts" in body:  # TEI's shape: the list alone
        return JSONResponse([{"index": i, "score": scores[i], **({"text": documents[i]} if body.get("return_text")
                                                                  else {})} for i in order])
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.get("return_documents"):
            result["document"] = {"text": documents[i]}
        results.append(result)
    return JSONResponse({"model": state.model_name, "object": "list",
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}, "results": results})
