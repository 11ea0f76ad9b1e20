"""One step's inputs as host lists: what the model runner builds a forward's tensors from, on every rank.

Rank 0 makes them from the scheduler's batch. Under tensor parallelism it packs them into one int64 buffer of a
size fixed at start-up, and one broadcast carries it to the other ranks, which unpack it and run the same forward
(token ids and the per-sequence spans and block tables: positions, KV slots and logits rows follow from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpullama.distributed import TensorParallel
from gpullama.engine.scheduler import ScheduledBatch
from gpullama.engine.sequence import Sequence
from gpullama.vision import rope_positions

_STEP, _STOP = 1, 2  # message kinds
_HEADER = 6  # kind, sequences, tokens, every_row, decode, table entries


@dataclass
class StepInputs:
    """The tokens one forward computes: sequence i adds ``num_new[i]`` tokens after its ``num_computed[i]`` cached
    ones, its k/v go to the blocks of ``block_tables[i]``; logits come for the last ``samples[i]`` new tokens of each
    sequence (0: none; 1: its last token; more: its last token and its draft tokens), or for every token with
    `every_row` (scoring). `pool_rows` (rank 0 only, never broadcast:
    pooling reads the hidden states rank 0 has after the last all-reduce) names the rows whose final hidden states
    come back pooled: (sequence i, "all" | "last" | "first" | "each" of its new rows). `state_slots` (rank 0 only:
    tensor parallelism refuses models with recurrent layers) are the sequences' slots of the recurrent layers'
    states (-1: the runner's scratch slot, as for scoring)."""

    token_ids: list[int]
    num_computed: list[int]
    num_new: list[int]
    block_tables: list[list[int]]
    samples: list[int]
    every_row: bool = False
    decode: bool = False  # every sequence adds one token and samples: the shape of the static decode buffers
    pool_rows: list[tuple[int, str]] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    # images (rank 0 only: tensor parallelism refuses an mmproj): (first row, embeddings) in place of the token
    # embeddings of those rows; (sequence i, first row, rows, context end) of each image's rows in this step, which
    # attend to the whole image (every key before the context end), not causally
    embeds: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    image_rows: list[tuple[int, int, int, int]] = field(default_factory=list)
    # rank 0 only: M-RoPE positions (time, row, column lists) of every row, when a sequence has an image with
    # them (Qwen2-VL); [] otherwise (the rows' positions on every axis)
    rope_positions: list[list[int]] = field(default_factory=list)
    # rank 0 only (adapters refuse tensor parallelism): each sequence's LoRA adapters, (id, scale) pairs; [] none
    loras: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> StepInputs:
        """The inputs of a scheduled batch."""
        ids: list[int] = []
        samples: list[int] = []
        embeds: list[tuple[int, torch.Tensor]] = []
        image_rows: list[tuple[int, int, int, int]] = []
        mrope = any(span.rope is not None for seq in batch.seqs for span in seq.images)
        rope: list[list[int]] = [[], [], []] if mrope else []
        for i, (seq, n, drafts) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.drafts)):
            own = n - len(drafts)
            first = seq.num_computed_tokens
            _image_inputs(seq, i, first, own, len(ids), embeds, image_rows)
            ids.extend(seq.token_ids[first : first + own])
            ids.extend(drafts)
            if mrope:
                for axis, values in zip(rope, rope_positions(seq.images, first, first + n)):
                    axis.extend(values)
            reaches_end = seq.pooling is None and seq.num_computed_tokens + own == seq.num_tokens
            samples.append(1 + len(drafts) if reaches_end else 0)
        return cls(
            token_ids=ids,
            num_computed=[seq.num_computed_tokens for seq in batch.seqs],
            num_new=list(batch.num_new_tokens),
            block_tables=[seq.block_table for seq in batch.seqs],
            samples=samples,
            decode=batch.is_decode and not embeds and not rope,
            pool_rows=list(batch.pool_rows),
            state_slots=[seq.state_slot for seq in batch.seqs],
            embeds=embeds,
            image_rows=image_rows,
            rope_positions=rope,
            loras=[seq.lora for seq in batch.seqs] if any(seq.lora for seq in batch.seqs) else [],
        )

    @classmethod
    def for_scoring(cls, seq: Sequence) -> StepInputs:
        """Every token of `seq` (its blocks allocated, none computed), with logits after each."""
        embeds: list[tuple[int, torch.Tensor]] = []
        image_rows: list[tuple[int, int, int, int]] = []
        _image_inputs(seq, 0, 0, seq.num_tokens, 0, embeds, image_rows)
        mrope = any(span.rope is not None for span in seq.images)
        return cls(list(seq.token_ids), [0], [seq.num_tokens], [seq.block_table], [1], every_row=True,
                   embeds=embeds, image_rows=image_rows,
                   rope_positions=rope_positions(seq.images, 0, seq.num_tokens) if mrope else [],
                   loras=[seq.lora] if seq.lora else [])


def _image_inputs(seq: Sequence, i: int, first: int, own: int, row: int, embeds: list, image_rows: list) -> None:
    """Append the image embeddings of `seq`'s tokens ``first .. first + own`` (sequence `i` of the step, its first
    row `row`) to `embeds`, and the rows of its images that attend both ways to `image_rows`."""
    for span in seq.images:
        lo, hi = max(span.start, first), min(span.end, first + own)
        if lo < hi:
            embeds.append((row + lo - first, span.embeds[lo - span.start : hi - span.start]))
            if not span.causal:  # the scheduler never splits such an image: its rest is in this step
                assert hi == span.end, "an image span was split across steps"
                image_rows.append((i, row + lo - first, hi - lo, span.end))


def step_buffer_size(max_num_seqs: int, max_tokens: int, max_blocks_per_seq: int) -> int:
    """int64 entries of the step buffer that holds any step within these limits."""
    return _HEADER + 4 * max_num_seqs + max_tokens + max_num_seqs * max_blocks_per_seq


class StepBroadcast:
    """Carries each step's inputs from rank 0 to the other ranks: one broadcast of one fixed-size buffer per step."""

    def __init__(self, tp: TensorParallel, size: int):
        self.tp = tp
        self.buffer = torch.zeros(size, dtype=torch.long)

    def send(self, step: StepInputs) -> None:
        """Rank 0: hand `step` to the other ranks."""
        b = len(step.num_new)
        tables = [block for table in step.block_tables for block in table]
        values = [_STEP, b, len(step.token_ids), int(step.every_row), int(step.decode), len(tables)]
        values += step.num_computed + step.num_new + [len(t) for t in step.block_tables]
        values += [int(s) for s in step.samples] + step.token_ids + tables
        if len(values) > self.buffer.numel():
            raise ValueError(f"a step of {len(values)} entries is larger than the step buffer ({self.buffer.numel()})")
        self.buffer[: len(values)] = torch.tensor(values, dtype=torch.long)
        self.tp.broadcast_from_first(self.buffer)

    def send_stop(self) -> None:
        """Rank 0: tell the other ranks that no step follows."""
        self.buffer[0] = _STOP
        self.tp.broadcast_from_first(self.buffer)

    def receive(self) -> StepInputs | None:
        """Ranks > 0: wait for rank 0's next step (None: stop)."""
        self.tp.broadcast_from_first(self.buffer)
        kind, b, t, every_row, decode, n_tables = self.buffer[:_HEADER].tolist()
        if kind == _STOP:
            return None
        values = self.buffer[_HEADER : _HEADER + 4 * b + t + n_tables].tolist()
        num_computed, num_new, table_lens = values[:b], values[b : 2 * b], values[2 * b : 3 * b]
        samples = values[3 * b : 4 * b]
        token_ids = values[4 * b : 4 * b + t]
        flat = values[4 * b + t :]
        tables, start = [], 0
        for n in table_lens:
            tables.append(flat[start : start + n])
            start += n
        return StepInputs(token_ids, num_computed, num_new, tables, samples, bool(every_row), bool(decode))
