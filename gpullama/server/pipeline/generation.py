"""Run the choices of one API request on the engine: submit under the server's limits, merge their streams, abort
whatever is left on exit."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from gpullama.checks import RequestError
from gpullama.engine.errors import EngineError, EngineStopped
from gpullama.outputs import StreamDelta
from gpullama.pooling_params import PoolingParams
from gpullama.sampling_params import SamplingParams

from ..http.errors import APIError, internal_error, request_error
from ..http.metrics import ServerMetrics
from ..http.middleware import request_id
from ..http.request_log import current_request
from ..http.streaming import ClientDisconnected, unless_disconnected
from ..state import ServerState

log = logging.getLogger("gpullama.server")


@dataclass
class Job:
    """One choice: its prompt ids, sampling params and which prompt it belongs to; or one input of an embedding
    request (`pooling` set: its one delta carries the embedding)."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams | None
    prompt_index: int = 0
    request_id: str = ""  # the engine's id, set when the answer gets its id
    pooling: PoolingParams | None = None
    lora: list[tuple[int, float]] | None = None  # an embedding input's adapters (a choice's are in its params)


def images_of(prompt_ids: list[int]) -> dict:
    """The engine's ``images`` keyword for a prompt with images (`gpullama.vision.prompt.PromptIds`), else none."""
    images = getattr(prompt_ids, "images", None)
    return {"images": images} if images else {}


def _api_error(exc: Exception, job: Job, http_request_id: str = "-") -> APIError:
    """An engine error as the client sees it: the admission check's in the common plan's field names (the API's
    boundary renames them), a failure of ours as a 500 with only the request id."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return request_error(exc)
    if isinstance(exc, ValueError):  # a StructuredOutputError names its field
        return APIError(400, str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, EngineStopped):
        return APIError(503, str(exc), code="engine_stopped")
    # the client gets the request id, not the detail; the engine already logged a failed step with its traceback
    log.error("generation failed for %s (request id %s): %s", job.request_id, http_request_id, exc,
              exc_info=None if isinstance(exc, EngineError) else exc)
    return internal_error(http_request_id, code="generation_failed")


class Generation:
    """The engine streams of one API request, yielded as ``(choice index, delta)`` in arrival order.

    ``start()`` submits every choice and waits for each one's first delta, so errors the engine raises up front
    (a prompt that does not fit) become HTTP errors. ``close()`` aborts every choice that has not finished.
    """

    def __init__(self, engine: Any, jobs: list[Job], metrics: ServerMetrics, arrival: float,
                 http_request_id: str = "-") -> None:
        self.engine = engine
        self.http_request_id = http_request_id
        self.interrupted: APIError | None = None  # why the request was ended early (timeout)
        self._deadline: asyncio.TimerHandle | None = None
        self.jobs = jobs
        self.metrics = metrics
        self.arrival = arrival
        self.finished: set[int] = set()
        self._streams: dict[int, Any] = {}
        self._buffer: list[tuple[int, StreamDelta]] = []
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_time: dict[int, float] = {}
        self._first_time: dict[int, float] = {}  # choice index -> its first token's time
        self._choice_tokens: dict[int, int] = {}  # choice index -> tokens generated
        self._closed = False
        self._generated = 0
        self._cached: dict[int, int] = {}  # prompt index -> prompt tokens served from the prefix cache
        self.first_token_at: float | None = None  # perf_counter() of the request's first and last token
        self.last_token_at: float | None = None
        self.finish_reasons: dict[int, str] = {}  # choice index -> finish reason
        record = current_request.get()
        if record is not None:  # the access log line reports this request's tokens
            record.generations.append(self)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated so far, over all choices."""
        return self._generated

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        return sum(self._cached.values())

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the request, each distinct prompt counted once (n choices share it)."""
        return sum({job.prompt_index: len(job.prompt_ids) for job in self.jobs}.values())

    def _submit(self, job: Job) -> None:
        try:
            if job.pooling is not None:
                self._streams[job.index] = self.engine.embed(job.request_id, job.prompt_ids, job.pooling, job.lora)
            else:
                self._streams[job.index] = self.engine.generate(job.request_id, job.prompt_ids, job.params,
                                                                **images_of(job.prompt_ids))
        except Exception as exc:
            raise _api_error(exc, job, self.http_request_id) from exc

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
            raise _api_error(exc, self.jobs[index], self.http_request_id)
        self._check_interrupted(delta)
        return index, delta

    def _check_interrupted(self, delta: StreamDelta | None) -> None:
        """An "abort" that `interrupt` caused ends the request with the interrupting error."""
        if self.interrupted is not None and delta is not None and delta.finish_reason == "abort":
            raise self.interrupted

    def set_deadline(self, seconds: float, error: APIError) -> None:
        """Interrupt the request with `error` after `seconds` (unless it finished first)."""
        self._deadline = asyncio.get_running_loop().call_later(max(0.0, seconds), self.interrupt, error)

    def interrupt(self, error: APIError) -> None:
        """End the request now: abort its unfinished choices on the engine (each ends within one step) and raise
        `error` where its deltas are read, so a stream ends with that error event and ``[DONE]``."""
        if self._closed or self.interrupted is not None:
            return
        self.interrupted = error
        log.info("ending %s early: %s", self.jobs[0].request_id.rsplit("-", 1)[0], error.message)
        for job in self.jobs:
            if job.index not in self.finished and job.index in self._streams:
                self.engine.abort(job.request_id)

    async def start(self) -> None:
        """Submit all choices and wait for each first delta; raises ``APIError`` (400 or 500) on failure."""
        try:
            for job in self.jobs:
                self._submit(job)
            if len(self.jobs) == 1:
                try:
                    first = await anext(self._streams[0])
                except StopAsyncIteration:
                    log.error("the engine ended %s without output", self.jobs[0].request_id)
                    raise internal_error(self.http_request_id, code="generation_failed") from None
                except Exception as exc:
                    raise _api_error(exc, self.jobs[0], self.http_request_id) from exc
                self._check_interrupted(first)
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
                try:
                    async for delta in self._streams[0]:
                        self._check_interrupted(delta)
                        self._observe(0, delta)
                        yield 0, delta
                        if delta.finish_reason is not None:
                            break
                except APIError:
                    raise
                except Exception as exc:
                    raise _api_error(exc, self.jobs[0], self.http_request_id) from exc
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
        job = self.jobs[index]
        self._cached[job.prompt_index] = max(self._cached.get(job.prompt_index, 0), delta.num_cached_tokens)
        self._choice_tokens[index] = self._choice_tokens.get(index, 0) + count
        if count:
            self._observe_tokens(index, delta, count)
        if delta.finish_reason is not None:
            self.finished.add(index)
            self.finish_reasons[index] = delta.finish_reason
            if index in self._first_time:  # llama.cpp's generation counters, once per choice
                self.metrics.llamacpp.observe_choice(len(job.prompt_ids), self._choice_tokens[index],
                                                     self._last_time[index] - self._first_time[index])

    def _observe_tokens(self, index: int, delta: StreamDelta, count: int) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.metrics.generation_tokens.inc(count)
        last = self._last_time.get(index)
        if last is None:
            self._first_time[index] = now
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.llamacpp.observe_prompt(len(self.jobs[index].prompt_ids) - delta.num_cached_tokens,
                                                 now - self.arrival)
            count -= 1
        else:
            gap = (now - last) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        self._last_time[index] = now

    async def close(self) -> None:
        """Abort every unfinished choice on the engine and stop the merge tasks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._deadline is not None:
            self._deadline.cancel()
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


def prompt_progress(delta: StreamDelta, total: int, started: float, now: float) -> dict:
    """llama.cpp's ``prompt_progress`` of a progress delta: ``total``, ``cache``, ``processed``, ``time_ms``."""
    return {"total": total, "cache": delta.num_cached_tokens, "processed": delta.num_computed_prompt_tokens,
            "time_ms": (now - started) * 1e3}


async def start_generation(request: Request, state: ServerState, jobs: list[Job], arrival: float) -> Generation | None:
    """Submit a request's jobs under the server's limits: 429 past ``--max-queue``, a ``--request-timeout`` deadline,
    the engine's admission check (a bad job is a 400). None when the client left before every job was queued."""
    config = state.config
    queued = state.engine.num_queued
    if queued >= config.max_queue:
        raise APIError(429, f"the server is busy: {queued} requests are waiting for a place in the batch, the limit "
                       f"is {config.max_queue} (--max-queue); retry later", code="queue_full",
                       headers={"retry-after": "1"})
    gen = Generation(state.engine, jobs, state.metrics, arrival, request_id(request))
    if config.request_timeout:
        gen.set_deadline(config.request_timeout - (time.perf_counter() - arrival),
                         APIError(504, f"the request took longer than {config.request_timeout:g} seconds "
                                  "(--request-timeout)", code="request_timeout"))
    try:
        await unless_disconnected(request.receive, gen.start)
    except ClientDisconnected:
        return None
    state.metrics.prompt_tokens.inc(gen.num_prompt_tokens)
    return gen
