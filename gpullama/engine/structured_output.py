"""Grammar-constrained sampling in the engine: each constrained sequence's spec compiles off the step thread
(once per distinct spec), its matcher masks the logits of its row before sampling and accepts the sampled token.

The step thread never waits for a compilation while other work is there: the scheduler holds back a sequence's
last prompt token (the one that samples) until its grammar is ready, so the rest of its prompt prefills
meanwhile. Rows without a grammar are never touched. A preempted sequence keeps its matcher: recomputation
replays the same tokens, so the matcher's position is still right when it samples again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from gpullama.structured import get_backend
from gpullama.structured.backend import GrammarBackend, GrammarMatcher, compile_pool
from gpullama.structured.reasoning_gate import ReasoningGatedMatcher, reasoning_token_ids
from gpullama.structured.sequence_grammar import SequenceGrammar
from gpullama.structured.spec import StructuredOutput

if TYPE_CHECKING:
    from gpullama.engine.sequence import Sequence
    from gpullama.tokenizer import Tokenizer

log = logging.getLogger("gpullama")


class StructuredOutputManager:
    """The engine's grammar side: starts compilations, fills one bitmask per step for the constrained rows,
    applies it to their logits and advances their matchers. The backend (llguidance) is built on the compile pool
    by the first constrained request, so an engine that never sees one never imports it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)  # the logits width (may exceed the tokenizer's vocabulary)
        # On the CPU the model's threads hold every core during a step: extra fill threads only contend with them.
        self.fill_threads = 1 if torch.device(device).type == "cpu" else None
        self._backend: GrammarBackend | None = None
        self._reasoning_ids: dict[tuple[str, str], tuple[int, int] | None] = {}  # by (open tag, close tag)
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None

    # -- any thread -------------------------------------------------------------------------------------
    def submit(self, spec: StructuredOutput) -> SequenceGrammar:
        """Start compiling `spec` off the calling thread (a cache hit is ready at once); never blocks. Reasoning
        tags not seen before are looked up in the vocabulary on the compile pool too."""
        backend = self._backend
        tags = spec.reasoning_tags if spec.reasoning else None
        if backend is not None and (tags is None or tags in self._reasoning_ids):
            return SequenceGrammar(spec, backend.compile_async(spec))
        outer: Future = Future()
        outer.set_running_or_notify_cancel()

        def build() -> None:  # on the pool: build the backend (imports llguidance), then compile without waiting
            try:
                inner = self._get_backend().compile_async(spec)
                if tags is not None:
                    self.reasoning_ids(tags)
            except BaseException as e:  # noqa: BLE001 - handed to the sequence
                outer.set_exception(e)
                return
            inner.add_done_callback(lambda f: _copy_result(f, outer))

        compile_pool().submit(build)
        return SequenceGrammar(spec, outer)

    def _get_backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                backend = get_backend(self.tokenizer, self.vocab_size)
                self._reasoning_ids[("<think>", "</think>")] = reasoning_token_ids(self.tokenizer)
                self._backend = backend
            return self._backend

    def reasoning_ids(self, tags: tuple[str, str]) -> tuple[int, int] | None:
        """The token ids of reasoning tags `tags` (`reasoning_token_ids`), looked up once per pair."""
        with self._lock:
            if tags in self._reasoning_ids:
                return self._reasoning_ids[tags]
        ids = reasoning_token_ids(self.tokenizer, *tags)
        with self._lock:
            self._reasoning_ids[tags] = ids
        return ids

    # -- the step thread ---------------------------------------------------------------------------------
    def wait(self, seqs: list[Sequence], timeout: float) -> None:
        """Block up to `timeout` seconds until one of the grammars `seqs` wait for is ready (the engine calls
        this only when it has nothing else to run)."""
        pending = [s.grammar.future for s in seqs if s.grammar is not None and not s.grammar.ready]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def mask(self, logits: torch.Tensor, sampling: list[Sequence]) -> dict[int, BaseException]:
        """Mask, in place, the logits of the constrained rows of `sampling` (row i is ``sampling[i]``) to the
        tokens their grammars allow; other rows are untouched. Returns {row: error} for the sequences whose
        grammar failed to compile (their rows are left as they are, and must not be advanced)."""
        rows, matchers, failed = [], [], {}
        for row, seq in enumerate(sampling):
            if seq.grammar is None:
                continue
            try:
                matcher = self._matcher(seq)
            except Exception as e:  # noqa: BLE001 - the compile error of this request alone
                failed[row] = e
                continue
            rows.append(row)
            matchers.append(matcher)
        if not rows:
            return failed
        backend = self._backend
        assert backend is not None  # a matcher exists, so the backend was built
        bitmask = self._bitmask
        if bitmask is None or bitmask.shape[0] < len(sampling):
            bitmask = self._bitmask = backend.allocate_bitmask(max(len(sampling), 8))
        backend.fill_bitmask(matchers, bitmask, rows, threads=self.fill_threads)
        backend.apply_bitmask(logits, bitmask, rows)
        return failed

    def accept(self, seq: Sequence, token: int) -> bool | None:
        """Advance `seq`'s matcher by its sampled token: None if the grammar refused it, else whether the grammar
        has terminated (the sequence is done)."""
        matcher = seq.grammar.matcher
        if not matcher.accept_token(token):
            return None
        return matcher.is_terminated()

    def _matcher(self, seq: Sequence) -> GrammarMatcher:
        grammar = seq.grammar
        if grammar.matcher is None:
            compiled = grammar.future.result(timeout=0)  # ready: the scheduler held the sequence back until then
            backend = self._backend
            matcher = backend.matcher(compiled)
            tags = grammar.spec.reasoning_tags
            ids = self.reasoning_ids(tags) if grammar.spec.reasoning else None
            if ids is not None:
                rest = tags[0][len(self.tokenizer.token_bytes(ids[0]).decode("utf-8", "replace")):]
                opened = prompt_opens_reasoning(seq.prompt_token_ids, *ids, self.tokenizer, rest)
                matcher = ReasoningGatedMatcher(matcher, *ids, backend.stop_token_ids, start_in_reasoning=opened)
            grammar.matcher = matcher
        return grammar.matcher


def prompt_opens_reasoning(prompt_ids: list[int], open_id: int, close_id: int, tokenizer: Tokenizer,
                           rest: str = "") -> bool:
    """Whether the prompt ends inside a reasoning block: its last open-tag token is not closed and only
    whitespace follows it (as DeepSeek-R1 distill templates render the generation prompt), or `rest`, the text
    of an open tag longer than its token (Gemma 4's ``thought`` after ``<|channel>``), and whitespace."""
    try:
        last_open = len(prompt_ids) - 1 - prompt_ids[::-1].index(open_id)
    except ValueError:
        return False
    tail = prompt_ids[last_open + 1:]
    text = tokenizer.decode(tail).strip()
    return close_id not in tail and (not text or (bool(rest) and text == rest.strip()))


def _copy_result(source: Future, target: Future) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
