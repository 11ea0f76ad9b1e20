"""The engine behind an event loop: a background thread runs the step loop; requests stream back as deltas."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gpullama.engine.errors import EngineError, EngineStopped
from gpullama.engine.llm_engine import LLMEngine
from gpullama.engine.sequence import Sequence
from gpullama.outputs import StreamDelta
from gpullama.pooling_params import PoolingParams
from gpullama.sampling_params import SamplingParams
from gpullama.structured.spec import StructuredOutputError

log = logging.getLogger("gpullama")
__all__ = ["AsyncEngine", "EngineError", "EngineStopped"]




class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: StreamDelta | Exception) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    """Queue an admitted sequence; its deltas go to `stream`."""

    seq: Sequence
    stream: _Stream


@dataclass
class _Abort:
    """Drop a request (its stream gets a last delta with finish_reason "abort")."""

    request_id: str


class AsyncEngine:
    """Owns a thread that runs `LLMEngine.step()` while there is work; `generate` streams one request's deltas."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._stop_error: EngineError = EngineStopped("the engine has stopped")
        self._submitted = 0  # requests handed to the engine thread (written on the event loop only)
        self._taken = 0  # of those, the ones the engine thread has queued (written on the engine thread only)
        self._thread = threading.Thread(target=self._run, name="gpullama-engine", daemon=True)
        self._thread.start()

    # -- front ------------------------------------------------------------------------------------
    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, images: list | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Submit a request (call from the event loop) and return its stream of deltas; the last has a finish_reason.
        Raises RequestError (a ValueError) at once when the request can never run (see `LLMEngine.admit`).
        `images`: image embeddings in place of prompt tokens (`gpullama.vision.ImageSpan`)."""
        if not self.is_alive:
            raise EngineStopped("the engine is not running")
        return self._submit(self.engine.admit(request_id, list(prompt_token_ids), params, images=images))

    def embed(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams | None = None,
              lora: list[tuple[int, float]] | None = None) -> AsyncIterator[StreamDelta]:
        """Submit an embedding request (call from the event loop; `lora`: adapters as `SamplingParams.lora`); its
        stream has one delta, with the `embedding`. Raises RequestError at once when it can never run (see
        `LLMEngine.admit_embedding`)."""
        if not self.is_alive:
            raise EngineStopped("the engine is not running")
        return self._submit(self.engine.admit_embedding(request_id, list(prompt_token_ids), pooling, lora))

    def _submit(self, seq: Sequence) -> AsyncIterator[StreamDelta]:
        """Hand an admitted sequence to the engine thread; its stream of deltas."""
        request_id = seq.request_id
        stream = _Stream(asyncio.get_running_loop())
        self._submitted += 1
        self._commands.put(_Add(seq, stream))
        self._wake.set()
        if not self._thread.is_alive():  # the loop ended after the check above: nobody else will end this stream
            self._end_open_streams()
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[StreamDelta]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect, cancellation): free the request now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; thread-safe. Its blocks are freed within one step."""
        self._commands.put(_Abort(request_id))
        self._wake.set()

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a place in the batch (those submitted but not yet seen by the engine thread too)."""
        return len(self.engine.scheduler.waiting) + max(0, self._submitted - self._taken)

    @property
    def num_queued(self) -> int:
        """Waiting requests beyond the free places of the running batch: those that must wait for others to end."""
        free = max(0, self.engine.scheduler.max_num_seqs - self.num_running)
        return max(0, self.num_waiting - free)

    @property
    def kv_blocks_total(self) -> int:
        """Blocks in the KV pool."""
        return self.engine.block_manager.num_blocks

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block."""
        return self.engine.block_manager.block_size

    @property
    def kv_blocks_used(self) -> int:
        """KV blocks held by requests (blocks that only keep a cached prefix count as free)."""
        bm = self.engine.block_manager
        return bm.num_blocks - bm.num_free_blocks

    @property
    def is_alive(self) -> bool:
        """False once the step loop has stopped, or a tensor-parallel rank is gone (no step can run again)."""
        return self._thread.is_alive() and not self._stopped and self.engine.runner.failure is None

    def stop(self, error: EngineError | None = None) -> None:
        """Stop the step loop after its current step, without waiting: every open stream then ends with `error`
        (an `EngineStopped` by default), and so does every later `generate`. Thread-safe."""
        if error is not None:
            self._stop_error = error
        self._stopped = True
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the step loop and wait for the thread."""
        self.stop()
        self._thread.join(timeout=10)

    # -- the engine thread ---------------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._taken += 1
                try:
                    self.engine.add(command.seq)
                except ValueError as exc:  # admitted up front, so only a duplicate request id lands here
                    command.stream.put(exc)
                    continue
                self._streams[command.seq.request_id] = command.stream
            else:
                self.engine.abort(command.request_id)

    def _run(self) -> None:
        try:
            while not self._stopped:
                if self.engine.runner.failure is not None:  # a tensor-parallel rank is gone: end every stream
                    self.stop(EngineStopped(f"the engine has stopped: {self.engine.runner.failure}"))
                    break
                self._drain_commands()
                if not self.engine.has_work():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                try:
                    deltas = self.engine.step()
                except Exception as exc:  # a step that failed outside any one request's rows (the scheduler):
                    log.exception("engine step failed")  # the requests it carried fail; the engine goes on
                    for request_id in list(self.engine.requests):
                        self.engine.abort(request_id, notify=False)  # its stream gets the error instead
                        stream = self._streams.pop(request_id, None)
                        if stream is not None:
                            stream.put(EngineError(f"generation failed: {type(exc).__name__}: {exc}"))
                    continue
                for delta in deltas:
                    stream = self._streams.get(delta.request_id)
                    if stream is None:
                        continue
                    if delta.finish_reason is not None:
                        del self._streams[delta.request_id]
                    if delta.finish_reason == "error":  # this request alone failed; the rest of the batch went on
                        error = delta.error
                        if not isinstance(error, StructuredOutputError):  # not the request's own fault (a bad grammar is)
                            error = EngineError(f"generation failed: {type(error).__name__}: {error}")
                        stream.put(error)
                    else:
                        stream.put(delta)
        finally:
            self._end_open_streams()

    def _end_open_streams(self) -> None:
        """Once the loop has stopped: end every open stream, and every request not yet taken, with the stop error."""
        self._stopped = True
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id, notify=False)
            stream.put(self._stop_error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._taken += 1
                command.stream.put(self._stop_error)
