"""Continuous batching: which sequences run in the next step, and how many of their tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpullama.engine.block_manager import BlockManager
from gpullama.engine.sequence import Sequence, SequenceStatus
from gpullama.engine.state_checkpoints import last_prompt_boundary


@dataclass
class ScheduledBatch:
    """One step's work: the whole contract between the scheduler and the model runner.

    Each sequence computes ``num_new_tokens[i]`` tokens from its ``num_computed_tokens`` on (its KV blocks are
    already allocated); the ones in `sampling` reach their last token in this step and sample the next one. A
    sampling sequence may carry draft tokens (``drafts[i]``, n-gram speculation): they follow its last token as
    extra query tokens of the step (counted in ``num_new_tokens[i]``), and logits come for its last token and each
    draft, so the engine can check the drafts and keep the accepted ones. The
    embedding requests in `pooling` never sample: the hidden states of the rows `pool_rows` names (per entry: the
    sequence's place in `seqs` and which of its new rows: "all" for mean pooling, "last" (also a reranker's: its
    last row, as llama.cpp pools a causal reranker), "first", or "each" for pooling none) come back pooled, one row
    per entry (one per row for "each": `pool_counts`). `state_loads` are the (checkpoint, state slot) pairs of the
    sequences that joined with a prefix hit on a model with recurrent layers: their states at the hit's end, to copy
    into their slots before the step (`ModelRunner.load_checkpoints`; such a sequence may have no rows in it).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)
    pooling: list[Sequence] = field(default_factory=list)
    pool_rows: list[tuple[int, str]] = field(default_factory=list)
    state_loads: list[tuple[int, int]] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, drafts: list[int] | None = None) -> None:
        """Schedule `n` new tokens of `seq`, then its `drafts` (only when those `n` reach its last token)."""
        drafts = list(drafts or [])
        assert not drafts or seq.num_computed_tokens + n == seq.num_tokens
        self.seqs.append(seq)
        self.num_new_tokens.append(n + len(drafts))
        self.drafts.append(drafts)
        first, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        if seq.pooling is not None:
            self.pooling.append(seq)
            kind = seq.pooling.kind
            rows = "all" if kind == "mean" else "each" if kind == "none" else \
                "last" if kind in ("last", "rank") and end == seq.num_tokens else \
                "first" if kind == "cls" and first == 0 else None
            if rows is not None:
                self.pool_rows.append((len(self.seqs) - 1, rows))
        elif end == seq.num_tokens:
            self.sampling.append(seq)

    @property
    def pool_counts(self) -> list[int | None]:
        """For each `pool_rows` entry, its pooled rows: None for one summed row, else one per new token."""
        return [self.num_new_tokens[i] if rows == "each" else None for i, rows in self.pool_rows]

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly one token, its last, and samples: the uniform shape decode graphs take."""
        return len(self.sampling) == len(self.seqs) == self.num_tokens

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Fills each step under a token budget: running sequences first (decode or the next prefill chunk),
    then waiting ones; preempts the newest running sequence when the KV pool is full.

    A running sequence also holds one of `max_num_seqs` state slots (`Sequence.state_slot`: where the recurrent
    layers keep its state), taken when it joins the batch and given back when it finishes, is aborted or
    preempted. With prefix caching of recurrent states (the block manager's `state_checkpoints`), a sequence that
    joins with a prefix hit has its states loaded from the checkpoint at the hit's end (`ScheduledBatch.state_loads`),
    and a prefill chunk ends at the last block boundary inside the prompt, where the engine saves them; otherwise (a
    miss, a preempted sequence) its state starts again from zero at its first token."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.free_state_slots = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: slot 0 first

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; it joins the batch at the next step with room."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and send it back to the front of the queue (recomputed later)."""
        self.running.remove(seq)
        self._release_state_slot(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.pooled = None  # an embedding request is recomputed from its first token
        seq.spec_token_ids = []
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        """The next step: which sequences compute how many new tokens, with their KV slots allocated."""
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._num_new_tokens(seq, budget)
            if n == 0:
                continue  # its grammar is compiling and only its sampling token is left
            drafts = seq.spec_token_ids[: budget - n] if seq.num_computed_tokens + n == seq.num_tokens else []
            if drafts and not self.block_manager.can_append(seq, n + len(drafts)):
                drafts = []  # drafts never preempt anyone
            seq.spec_token_ids = []
            while not self.block_manager.can_append(seq, n + len(drafts)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.append(seq, n + len(drafts))
            batch.add(seq, n, drafts)
            budget -= n + len(drafts)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq, budget, use_prefix_cache=seq.pooling is None):
                break
            if not seq.num_cached_tokens and not seq.num_output_tokens:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.state_slot = self.free_state_slots.pop()  # running sequences never outnumber the slots
            self.running.append(seq)
            checkpoints = self.block_manager.state_checkpoints
            if checkpoints is not None and seq.num_computed_tokens:  # a hit: the states saved at its end
                end = self.block_manager.blocks[seq.block_table[seq.num_computed_tokens // self.block_size - 1]]
                batch.state_loads.append((checkpoints.lookup(end.hash), seq.state_slot))
            n = self._num_new_tokens(seq, budget)
            if n:
                batch.add(seq, n)
                budget -= n
        return batch

    def _release_state_slot(self, seq: Sequence) -> None:
        """Give a sequence's state slot back."""
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.block_manager.block_size

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute now: the rest of it within the budget, but never its sampling token while
        its grammar compiles (the prompt prefills meanwhile; the step thread never waits for a compilation), and
        never part of an image (the chunk ends before it, or the sequence waits for a step with room for all of it;
        admission keeps each image within `max_num_batched_tokens`). With recurrent-state checkpoints, a chunk
        that would pass the last block boundary inside the prompt ends there (not inside an image)."""
        left = seq.num_tokens - seq.num_computed_tokens
        if seq.waits_for_grammar:
            left -= 1
        n = max(0, min(left, budget))
        first, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        if self.block_manager.state_checkpoints is not None and seq.pooling is None:
            boundary = last_prompt_boundary(seq.num_prompt_tokens, self.block_size)
            if first < boundary < end and not any(not s.causal and s.start < boundary < s.end for s in seq.images):
                n, end = boundary - first, boundary
        for span in seq.images:  # a chunk never splits an image whose tokens attend to each other both ways
            if not span.causal and span.start < end < span.end:
                n = max(0, span.start - first)  # up to the image, or (the chunk starts at or in it) wait for room
                break
        return n

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the engine and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self._release_state_slot(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
