"""The grammar-engine interface: compile a spec (cached, thread-safe), one matcher per constrained sequence."""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from gpullama.structured.bitmask import allocate_bitmask, apply_bitmask
from gpullama.structured.spec import StructuredOutput


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled for one vocabulary; immutable and shared by every matcher made from it."""

    spec: StructuredOutput
    handle: Any  # the backend's own compiled object
    compile_s: float  # seconds the compilation took


class GrammarMatcher(ABC):
    """One sequence's position in its grammar. Not thread-safe: drive it from the step thread only."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (only EOS once the grammar terminated)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and an end-of-sequence token was accepted: the sequence is done."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar. (The engine does not need it on preemption: a preempted sequence keeps
        its matcher, which recomputation leaves at the right position; `gpullama.structured.sequence_grammar`.)"""


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def compile_pool() -> ThreadPoolExecutor:
    """The process-wide thread pool grammars compile on (two workers)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpullama-grammar")
        return _POOL


class GrammarBackend(ABC):
    """A grammar engine bound to one vocabulary: compiles specs (LRU-cached by spec) and makes matchers."""

    name = "abstract"

    def __init__(self, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = 256) -> None:
        self.vocab_size = int(vocab_size)
        self.stop_token_ids: tuple[int, ...] = tuple(stop_token_ids)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compile_threads = max(1, min(8, os.cpu_count() or 1))

    @abstractmethod
    def _compile(self, spec: StructuredOutput) -> Any:
        """Compile one spec (uncached); StructuredOutputError when the spec is invalid."""

    @abstractmethod
    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache or compiled now on this thread; thread-safe.

        Concurrent calls for one spec compile it once; an invalid spec raises StructuredOutputError (not cached).
        """
        future, mine = self._claim(spec)
        if mine:
            self._run(spec, future)
        return future.result()

    def compile_async(self, spec: StructuredOutput) -> Future:
        """A future of `compile(spec)`, compiled on the shared pool (done at once on a cache hit)."""
        future, mine = self._claim(spec)
        if mine:
            compile_pool().submit(self._run, spec, future)
        return future

    def cached(self, spec: StructuredOutput) -> CompiledGrammar | None:
        """The compiled grammar of `spec` if it is compiled already, else None (never compiles)."""
        with self._lock:
            future = self._cache.get(spec.key)
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def _claim(self, spec: StructuredOutput) -> tuple[Future, bool]:
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future, False
            future = Future()
            future.set_running_or_notify_cancel()
            self._cache[spec.key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future, True

    def _run(self, spec: StructuredOutput, future: Future) -> None:
        start = time.perf_counter()
        try:
            handle = self._compile(spec)
        except BaseException as e:  # the failure goes to every waiter, and the spec is not cached
            with self._lock:
                if self._cache.get(spec.key) is future:
                    del self._cache[spec.key]
            future.set_exception(e)
            return
        future.set_result(CompiledGrammar(spec, handle, time.perf_counter() - start))

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """A CPU bitmask of `batch_size` rows as wide as this backend's vocabulary (the logits width)."""
        return allocate_bitmask(batch_size, self.vocab_size)

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                     rows: Sequence[int] | None = None, threads: int | None = None) -> None:
        """Fill row ``rows[i]`` (default i) of `bitmask` for ``matchers[i]``; other rows are left as they are.
        `threads`: how many threads a backend may fill rows on (None: its default)."""
        rows = range(len(matchers)) if rows is None else rows
        if len(rows) != len(matchers):
            raise ValueError(f"{len(matchers)} matchers but {len(rows)} rows")
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """Set the logits of disallowed tokens to -inf in place, in rows `rows` (default all)."""
        apply_bitmask(logits, bitmask, rows)
