"""Engine counters and the periodic status line built from them (running and waiting requests, KV use, prompt and
generation tokens/s, prefix-cache hits), as vLLM logs while it serves."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the server imports this module, and its --help must not import torch (the scheduler does)
    from gpullama.engine.scheduler import ScheduledBatch


@dataclass
class EngineStats:
    """Running totals the engine thread bumps once per step; readers on other threads only read them."""

    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits are not computed)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generation_tokens: int = 0  # tokens sampled
    steps: int = 0
    scheduled_seqs: int = 0  # sequences in each step, summed over the steps (over `steps`: the average batch)
    draft_tokens: int = 0  # n-gram draft tokens checked (speculative decoding)
    accepted_tokens: int = 0  # of which the model accepted
    draft_checks: int = 0  # sequence steps that checked drafts

    def observe_drafts(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        """Count one sequence's checked drafts: `num_accepted` of `num_drafts` accepted, `num_emitted` tokens
        generated in the step (one more than the accepted drafts, unless the sequence finished before)."""
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.draft_checks += 1
        self.generation_tokens += num_emitted - 1  # `observe` counted one

    def observe(self, batch: ScheduledBatch) -> None:
        """Count one scheduled step (call before its sequences' computed counts advance)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            done = seq.num_computed_tokens
            self.prompt_tokens += max(0, min(n, seq.num_prompt_tokens - done))
            if done == seq.num_cached_tokens and not seq.num_output_tokens:  # its first step
                self.cached_tokens += seq.num_cached_tokens
        self.generation_tokens += len(batch.sampling)
        self.steps += 1
        self.scheduled_seqs += len(batch.seqs)


@dataclass(frozen=True)
class EngineStatus:
    """What the engine is doing at one moment, with its totals so far."""

    at: float
    running: int
    waiting: int
    kv_used_blocks: int
    kv_blocks: int
    block_size: int
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @classmethod
    def read(cls, engine) -> EngineStatus:
        """Read an `LLMEngine`'s status (from any thread: a moment's counts, each read once)."""
        stats = engine.stats
        blocks = engine.block_manager
        return cls(time.monotonic(), len(engine.scheduler.running), len(engine.scheduler.waiting),
                   blocks.num_blocks - blocks.num_free_blocks, blocks.num_blocks, blocks.block_size,
                   stats.prompt_tokens, stats.cached_tokens, stats.generation_tokens, stats.draft_tokens,
                   stats.accepted_tokens)

    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.running or self.waiting)

    def line(self, before: EngineStatus) -> str:
        """The status line for the interval since `before`: queue, KV use, throughput and prefix-cache hits."""
        seconds = max(self.at - before.at, 1e-9)
        prompt = self.prompt_tokens - before.prompt_tokens
        cached = self.cached_tokens - before.cached_tokens
        generated = self.generation_tokens - before.generation_tokens
        used = self.kv_used_blocks / max(self.kv_blocks, 1)
        hits = f"{cached / (prompt + cached):.1%}" if prompt + cached else "-"
        return (f"engine: {self.running} running, {self.waiting} waiting; KV cache {used:.1%} used "
                f"({self.kv_used_blocks * self.block_size} of {self.kv_blocks * self.block_size} tokens); "
                f"prompt {prompt / seconds:.1f} tokens/s, generation {generated / seconds:.1f} tokens/s; "
                f"prefix cache hits {hits}{self._drafts(before)}")

    def _drafts(self, before: EngineStatus) -> str:
        """The draft acceptance of the interval (n-gram speculation), or nothing when no draft was checked."""
        drafts = self.draft_tokens - before.draft_tokens
        if not drafts:
            return ""
        accepted = self.accepted_tokens - before.accepted_tokens
        return f"; draft acceptance {accepted / drafts:.1%} ({accepted} of {drafts})"
