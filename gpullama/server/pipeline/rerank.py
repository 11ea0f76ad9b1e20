"""Reranking every API family shares (llama.cpp's ``/rerank``, vLLM's ``/v1/score``): the reranker check, the
texts read, each (query, document) pair's prompt (`gpullama.rerank`) within the context, and the run on the
engine: one pooled request per pair, all submitted together, their scores collected in pair order."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request

from gpullama.checks import kind
from gpullama.pooling_params import RANK, PoolingParams

from ..http.errors import APIError
from ..http.fields import bad
from .embedding import run_embeddings

MAX_DOCUMENTS = 1000
"""Documents (pairs) per request, as Cohere's rerank API allows."""


def check_reranker(state: Any) -> None:
    """400 unless the served model is a reranker (a GGUF with pooling_type rank and a classification head)."""
    if not state.llm.is_reranker:
        raise APIError(400, f"the model `{state.model_name}` is not a reranker (a GGUF with pooling_type rank and a "
                       "classification head, cls.output.weight, such as a converted Qwen3-Reranker): it cannot "
                       "rerank or score", param="model")


def texts(value: Any, name: str, objects: bool = False) -> list[str]:
    """A non-empty list of strings (a lone string is a list of one), at most `MAX_DOCUMENTS`; with `objects`, an
    item may also be ``{"text": string}`` (Jina's and Cohere's document objects)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise bad(name, f"'{name}' must be a non-empty array of strings, got {kind(value)}")
    if len(items) > MAX_DOCUMENTS:
        raise bad(name, f"'{name}' holds {len(items)} texts; the limit is {MAX_DOCUMENTS}")
    out = []
    for i, item in enumerate(items):
        if objects and isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str):
            raise bad(f"{name}[{i}]", f"'{name}[{i}]' must be a string{' or {text: string}' if objects else ''}, "
                      f"got {kind(item)}")
        out.append(item)
    return out


def pair_prompts(state: Any, pairs: list[tuple[str, str]], query_names: list[str],
                 names: list[str]) -> list[list[int]]:
    """Each (query, document) pair's prompt ids; a 400 naming pair i's query (`query_names[i]`) when its prompt
    alone, or its document (`names[i]`) when the pair's, is longer than the context or the KV pool holds."""
    llm = state.llm
    limits = llm.engine.limits
    limit = min(limits.max_model_len, limits.kv_capacity_tokens)
    prompts, checked = [], set()
    for (query, document), query_name, name in zip(pairs, query_names, names):
        if query not in checked:
            checked.add(query)
            n = len(llm.rerank_prompt(query, ""))
            if n > limit:
                raise bad(query_name, f"'{query_name}' makes a prompt of {n} tokens before any document; the model "
                          f"takes at most {limit} tokens (its context and KV pool)")
        ids = llm.rerank_prompt(query, document)
        if len(ids) > limit:
            raise bad(name, f"'{name}' makes a prompt of {len(ids)} tokens with the query; the model takes at most "
                      f"{limit} tokens (its context and KV pool)")
        prompts.append(ids)
    return prompts


async def run_scores(request: Request, state: Any, prompts: list[list[int]], request_id: str,
                     arrival: float | None = None) -> tuple[list[float], int] | None:
    """Each prompt's score (the reranker head's first output) and the prompt tokens counted; None when the client
    left first."""
    arrival = time.perf_counter() if arrival is None else arrival
    done = await run_embeddings(request, state, prompts, PoolingParams(normalize=False, kind=RANK), request_id,
                                arrival)
    if done is None:
        return None
    outputs, num_tokens = done
    return [float(v[0]) for v in outputs], num_tokens
