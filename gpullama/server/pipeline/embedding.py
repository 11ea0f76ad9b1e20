"""Embedding inputs run on the engine (every API family's embeddings endpoint uses it): one engine request per
input, all submitted together, their vectors collected in input order."""

from __future__ import annotations

import time

from starlette.requests import Request

from gpullama.pooling_params import PoolingParams

from ..http.streaming import unless_disconnected
from ..state import ServerState
from .generation import Job, start_generation


async def run_embeddings(request: Request, state: ServerState, inputs: list[list[int]], pooling: PoolingParams,
                         request_id: str, arrival: float | None = None) -> tuple[list[list[float]], int] | None:
    """The embedding of each input (token ids) and the prompt tokens counted; None when the client left first.
    Errors are the engine's admission errors (400, in the common plan's names: ``prompt`` is the input)."""
    arrival = time.perf_counter() if arrival is None else arrival
    jobs = [Job(i, ids, None, prompt_index=i, request_id=f"{request_id}-{i}", pooling=pooling)
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
