"""Embeddings every API family shares: their inputs read (`parse_inputs`, llama.cpp's prompt shapes) and tokenized,
the pooling of the APIs that answer one vector per input, and the run on the engine: one engine request per input,
all submitted together, their vectors collected in input order."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request

from gpullama.pooling_params import PoolingParams

from ..http.errors import APIError
from ..http.fields import bad
from ..http.streaming import unless_disconnected
from ..registry import request_lora
from ..state import ServerState
from .generation import Job, start_generation
from .prompts import Pieces, prompt_list, tokenize_pieces

MAX_INPUTS = 2048  # inputs per request, as the OpenAI API allows
ENCODINGS = ("float", "base64")


async def run_embeddings(request: Request, state: ServerState, inputs: list[list[int]], pooling: PoolingParams,
                         request_id: str, arrival: float | None = None) -> tuple[list[list[float]], int] | None:
    """The embedding of each input (token ids), under the request's LoRA adapters (`request_lora`: the one its
    ``model`` names, else the server's), and the prompt tokens counted; None when the client left first. Errors are
    the engine's admission errors (400, in the common plan's names: ``prompt`` is the input)."""
    arrival = time.perf_counter() if arrival is None else arrival
    lora = request_lora(request, state)
    jobs = [Job(i, ids, None, prompt_index=i, request_id=f"{request_id}-{i}", pooling=pooling, lora=lora)
            for i, ids in enumerate(inputs)]
    gen = await start_generation(request, state, jobs, arrival)
    if gen is None:
        return None

    async def collect() -> list[list[float]]:
        vectors: dict[int, list[float]] = {}
        try:
            async for index, delta in gen.deltas():
                if delta.embedding is not None:
                    vectors[index] = delta.embedding
        finally:
            await gen.close()
        return [vectors[i] for i in range(len(inputs))]

    return await unless_disconnected(request.receive, collect), gen.num_prompt_tokens


def one_vector_pooling(state: ServerState, dimensions: int | None = None) -> PoolingParams:
    """The pooling of an API that answers one vector per input: the server's ``--pooling`` (else the model's);
    ``--pooling none`` is a 400 here, as llama.cpp answers it (its native ``/embeddings`` gives per-token vectors)."""
    if state.config.pooling == "none":
        raise APIError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type (or "
                       "llama.cpp's native POST /embeddings)", param="prompt")
    return PoolingParams(dimensions=dimensions, kind=state.config.pooling)


def parse_inputs(value: Any, name: str = "input", mixed: bool = False) -> list[Pieces]:
    """The inputs (`gpullama.server.pipeline.prompts`): a string, a list of strings, token ids or lists of them,
    and llama.cpp's forms (strings and ids mixed inside an input, ``{"prompt_string": ...}``, ``{"content": [text
    parts]}``; `mixed`: a top-level list holding an id is one input, as llama.cpp reads it); at most `MAX_INPUTS`,
    no empty string."""
    inputs = prompt_list(value, name, MAX_INPUTS, content=True, mixed=mixed)
    for i, pieces in enumerate(inputs):
        if pieces == [""]:
            raise bad(f"{name}[{i}]", f"'{name}[{i}]' is an empty string")
    return inputs


def tokenize_inputs(tokenizer: Any, inputs: list[Pieces]) -> list[list[int]]:
    """Each input's token ids: its text tokenized as a completion prompt is (the model's BOS/EOS rules)."""
    return [tokenize_pieces(tokenizer, pieces) for pieces in inputs]
