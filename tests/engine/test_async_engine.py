"""The async front: concurrent streams, cancellation of half of 20 in-flight requests, aborts, up-front errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

from gpullama import LLM
from gpullama.engine import AsyncEngine
from gpullama.outputs import StreamDelta
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import assert_pool_idle, make_engine, random_prompt, solo_runs

TINY_VOCAB, TINY_BOS = 700, 700
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
STREAM_TIMEOUT_S = 30
ABORT_TIMEOUT_S = 10  # every stream here ends in well under a second when the engine is right


def twenty_prompts() -> list[list[int]]:
    """20 random prompts of 5..120 tokens, two pairs sharing a prefix."""
    gen = torch.Generator().manual_seed(99)
    prompts = [random_prompt(gen, 5 + (i * 37) % 116, TINY_VOCAB, TINY_BOS) for i in range(18)]
    prompts += [prompts[3] + random_prompt(gen, 7, TINY_VOCAB), prompts[8] + random_prompt(gen, 3, TINY_VOCAB)]
    return prompts


@pytest.fixture
def async_engine(tiny_llm: LLM) -> Iterator[AsyncEngine]:
    """An AsyncEngine over a fresh 8-slot engine with a 64-token step budget; shut down after the test."""
    engine = AsyncEngine(make_engine(tiny_llm, max_num_seqs=8, max_num_batched_tokens=64))
    yield engine
    engine.shutdown()


def wait_idle(engine: AsyncEngine, timeout_s: float = 60.0) -> None:
    """Wait until the engine thread has drained every command and request, and has come back to the top of its
    loop (so no step is in progress)."""
    deadline = time.monotonic() + timeout_s
    while engine.engine.has_work() or engine.num_running or engine.num_waiting or not engine._commands.empty():
        assert time.monotonic() < deadline, "the engine still has work long after every stream ended"
        time.sleep(0.01)
    engine.abort("wait-idle: no such request")  # a no-op command: the thread takes it between steps
    while not engine._commands.empty():
        assert time.monotonic() < deadline, "the engine thread does not come back to take its commands"
        time.sleep(0.01)


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], cancel: bool) -> list[StreamDelta]:
    """Read one request's stream; with `cancel`, stop after the first delta and close the stream."""
    stream = engine.generate(rid, prompt, PARAMS)
    deltas = []
    async for delta in stream:
        deltas.append(delta)
        if cancel:
            break
    if cancel:
        await stream.aclose()
    return deltas


def test_cancel_half_of_20_streams(async_engine: AsyncEngine, tiny_llm: LLM) -> None:
    """20 concurrent streams, 10 closed after their first delta: the other 10 stream exactly their solo text and
    tokens, and the pool ends with every block free."""
    prompts = twenty_prompts()
    cancel = [i % 2 == 1 for i in range(20)]

    async def main() -> list[list[StreamDelta]]:
        tasks = [collect(async_engine, f"a{i}", p, c) for i, (p, c) in enumerate(zip(prompts, cancel))]
        return await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S)

    results = asyncio.run(main())
    kept = [i for i in range(20) if not cancel[i]]
    want = solo_runs(tiny_llm, [prompts[i] for i in kept], PARAMS)
    for i, ref in zip(kept, want):
        deltas = results[i]
        assert deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert [t for d in deltas for t in d.token_ids] == ref.output_token_ids, f"stream {i} differs from solo"
        assert "".join(d.text for d in deltas) == ref.text
        assert deltas[-1].num_generated_tokens == PARAMS.max_tokens
    for i in range(20):
        if cancel[i]:
            assert len(results[i]) == 1
    wait_idle(async_engine)
    assert_pool_idle(async_engine.engine.block_manager)
    assert not async_engine.engine.requests


def test_abort_ends_the_stream_with_abort(async_engine: AsyncEngine, tiny_llm: LLM) -> None:
    """`AsyncEngine.abort(id)` on a live stream: the reader gets a last delta with finish_reason "abort" (it does
    not hang), the other streams finish normally, and the pool is freed."""
    prompts = twenty_prompts()[:6]

    async def read(i: int, prompt: list[int]) -> list[StreamDelta]:
        deltas = []
        async for delta in async_engine.generate(f"b{i}", prompt, PARAMS):
            deltas.append(delta)
            if i % 2 == 0 and len(deltas) == 1:
                async_engine.abort(f"b{i}")
        return deltas

    async def main() -> list[list[StreamDelta]]:
        tasks = [asyncio.wait_for(read(i, p), ABORT_TIMEOUT_S) for i, p in enumerate(prompts)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    for i, result in enumerate(results):
        assert not isinstance(result, BaseException), f"stream {i} did not end: {type(result).__name__}"
        assert result[-1].finish_reason == ("abort" if i % 2 == 0 else "length"), f"stream {i}"
    wait_idle(async_engine)
    assert_pool_idle(async_engine.engine.block_manager)


def test_generate_rejects_impossible_requests_at_once(async_engine: AsyncEngine) -> None:
    """A prompt over the context raises ValueError from `generate` itself; the engine keeps serving."""
    too_long = list(range(1, 301))

    async def main() -> list[StreamDelta]:
        with pytest.raises(ValueError, match="300"):
            async_engine.generate("too-long", too_long, PARAMS)
        with pytest.raises(ValueError, match="250"):
            async_engine.generate("too-many", too_long[:100], SamplingParams(max_tokens=250))
        return [d async for d in async_engine.generate("fine", twenty_prompts()[0], PARAMS)]

    deltas = asyncio.run(asyncio.wait_for(main(), STREAM_TIMEOUT_S))
    assert deltas[-1].finish_reason == "length"
    wait_idle(async_engine)
    assert_pool_idle(async_engine.engine.block_manager)
