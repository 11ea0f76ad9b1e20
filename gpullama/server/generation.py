"""Run the choices of one API request on the engine: submit, merge their streams, abort whatever is left on exit."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gpullama.engine.admission import RequestError
from gpullama.outputs import StreamDelta
from gpullama.sampling_params import SamplingParams

from .errors import APIError
from .metrics import ServerMetrics
from .responses import usage

log = logging.getLogger("gpullama.server")


@dataclass
class Job:
    """One choice: its prompt ids, sampling params, which prompt it belongs to, and the request's names of the
    fields the engine's admission errors speak of."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    prompt_param: str = "prompt"  # "messages" for chat
    max_tokens_param: str = "max_tokens"  # or "max_completion_tokens"
    request_id: str = ""  # the engine's id, set when the answer gets its id


def _api_error(exc: Exception, job: Job) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        param = {"prompt": job.prompt_param, "max_tokens": job.max_tokens_param}.get(exc.param, exc.param)
        return APIError(400, str(exc), param=param)
    if isinstance(exc, ValueError):  # a StructuredOutputError names its field
        return APIError(400, str(exc), param=getattr(exc, "param", None))
    log.exception("generation failed for request %s", job.request_id, exc_info=exc)
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="generation_failed")


class Generation:
    """The engine streams of one API request, yielded as ``(choice index, delta)`` in arrival order.

    ``start()`` submits every choice and waits for each one's first delta, so errors the engine raises up front
    (a prompt that does not fit) become HTTP errors. ``close()`` aborts every choice that has not finished.
    """

    def __init__(self, engine: Any, jobs: list[Job], metrics: ServerMetrics, arrival: float) -> None:
        self.engine = engine
        self.jobs = jobs
        self.metrics = metrics
        self.arrival = arrival
        self.finished: set[int] = set()
        self._streams: dict[int, Any] = {}
        self._buffer: list[tuple[int, StreamDelta]] = []
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_time: dict[int, float] = {}
        self._closed = False
        self._generated = 0
        self._cached: dict[int, int] = {}  # prompt index -> prompt tokens served from the prefix cache

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the request, each distinct prompt counted once (n choices share it)."""
        return sum({job.prompt_index: len(job.prompt_ids) for job in self.jobs}.values())

    def usage(self) -> dict:
        """OpenAI's usage object for the tokens seen so far."""
        return usage(self.num_prompt_tokens, self._generated, sum(self._cached.values()))

    def _submit(self, job: Job) -> None:
        try:
            self._streams[job.index] = self.engine.generate(job.request_id, job.prompt_ids, job.params)
        except Exception as exc:
            raise _api_error(exc, job) from exc

    async def _pump(self, job: Job) -> None:
        assert self._queue is not None
        try:
            async for delta in self._streams[job.index]:
                self._queue.put_nowait((job.index, delta, None))
            self._queue.put_nowait((job.index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((job.index, None, exc))

    async def _next_merged(self) -> tuple[int, StreamDelta | None]:
        assert self._queue is not None
        index, delta, exc = await self._queue.get()
        if exc is not None:
            raise _api_error(exc, self.jobs[index])
        return index, delta

    async def start(self) -> None:
        """Submit all choices and wait for each first delta; raises ``APIError`` (400 or 500) on failure."""
        try:
            for job in self.jobs:
                self._submit(job)
            if len(self.jobs) == 1:
                try:
                    first = await anext(self._streams[0])
                except StopAsyncIteration:
                    raise APIError(500, "the engine ended the request without output", code="generation_failed") from None
                except Exception as exc:
                    raise _api_error(exc, self.jobs[0]) from exc
                self._buffer.append((0, first))
                return
            self._queue = asyncio.Queue()
            self._tasks = [asyncio.create_task(self._pump(job)) for job in self.jobs]
            seen: set[int] = set()
            while len(seen) < len(self.jobs):
                index, delta = await self._next_merged()
                seen.add(index)
                if delta is not None:
                    self._buffer.append((index, delta))
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Every delta of every choice; marks choices finished and records token metrics on the way."""
        for index, delta in self._buffer:
            self._observe(index, delta)
            yield index, delta
        self._buffer.clear()
        if len(self.jobs) == 1:
            if 0 not in self.finished:
                async for delta in self._streams[0]:
                    self._observe(0, delta)
                    yield 0, delta
                    if delta.finish_reason is not None:
                        break
            self.finished.add(0)
            return
        while len(self.finished) < len(self.jobs):
            index, delta = await self._next_merged()
            if delta is None:
                self.finished.add(index)
                continue
            self._observe(index, delta)
            yield index, delta

    def _observe(self, index: int, delta: StreamDelta) -> None:
        count = len(delta.token_ids)
        self._generated += count
        p = self.jobs[index].prompt_index
        self._cached[p] = max(self._cached.get(p, 0), delta.num_cached_tokens)
        if delta.finish_reason is not None:
            self.finished.add(index)
        if not count:
            return
        now = time.perf_counter()
        last = self._last_time.get(index)
        if last is None:
            self.metrics.ttft.observe(now - self.arrival)
            count -= 1
        else:
            gap = (now - last) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        self._last_time[index] = now
        self.metrics.generation_tokens.inc(len(delta.token_ids))

    async def close(self) -> None:
        """Abort every unfinished choice on the engine and stop the merge tasks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for job in self.jobs:
            if job.index not in self.finished and job.index in self._streams:
                self.finished.add(job.index)
                try:
                    self.engine.abort(job.request_id)
                except Exception:  # noqa: BLE001 - aborting must never mask the original outcome
                    log.exception("aborting request %s failed", job.request_id)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams.values():
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001
                    pass
        self._streams.clear()
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
