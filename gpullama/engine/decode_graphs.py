"""Decode steps on static buffers: padded to a ladder of batch sizes, captured as CUDA graphs where the ops allow.

A decode step (one new token per sequence, every row sampling) copies its inputs into buffers allocated once,
padded up to the smallest size of the ladder that holds the batch; with graphs, each size was captured once and
is replayed, so a decode step launches no kernel from Python and allocates nothing. Padded rows write their k/v
into a reserved scratch block (their recurrent state into the scratch state slot) and their logits are dropped.
"""

from __future__ import annotations

import logging

import torch

from gpullama.model import Decoder
from gpullama.ops import BatchMetadata

log = logging.getLogger("gpullama")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The ladder of padded decode batch sizes: 1, 2, 4, 8, then steps of 16 up to `max_num_seqs`."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static decode buffers (and, with `use_graphs`, one captured CUDA graph per batch size) over a KV pool."""

    def __init__(
        self,
        model: Decoder,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        use_graphs: bool,
        states: list[torch.Tensor] = (),
        scratch_state_slot: int = 0,
    ):
        self.model = model
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.states = states
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}
        device = model.ops.device
        n, block_size = max_num_seqs, k_caches[0].shape[1]
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.token_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=device)
        self.scratch_state_slot = scratch_state_slot
        self.state_slots = torch.full((n,), scratch_state_slot, dtype=torch.long, device=device)
        if use_graphs:
            self._capture()

    def padded_size(self, batch: int) -> int | None:
        """The ladder size a decode batch of `batch` rows runs at (None when it is larger than them all)."""
        return next((s for s in self.batch_sizes if s >= batch), None)

    def _meta(self, size: int, max_seq_len: int, width: int) -> BatchMetadata:
        """Views of the static buffers for a padded batch of `size` rows whose block tables are `width` wide."""
        return BatchMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size, :width],
            logits_indices=self.logits_indices[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            state_slots=self.state_slots[:size] if self.states else None,
        )

    def captured_forward(self, size: int) -> torch.Tensor:
        """The forward a graph of `size` rows records: the first `size` rows of the static buffers, full-width block
        tables (replays read the values the buffers hold then, so one graph serves every context length)."""
        meta = self._meta(size, self.max_blocks_per_seq * self.block_size, self.max_blocks_per_seq)
        return self.model.forward(self.token_ids[:size], meta, self.k_caches, self.v_caches, self.states)

    def _capture(self) -> None:
        """Capture one decode graph per batch size (largest first, sharing one memory pool)."""
        pool = None
        for size in reversed(self.batch_sizes):
            for _ in range(2):  # compile the kernels and settle the allocator outside the capture
                self.captured_forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.captured_forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
            self.graph_logits[size] = logits
        log.info("captured decode graphs for batch sizes %s", self.batch_sizes)

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        state_slots: list[int] = (),
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one decode step: row i adds `token_ids[i]` at `positions[i]` (its k/v go to
        `slot_mapping[i]`, its recurrent state is slot `state_slots[i]`) and attends over the blocks of
        `block_tables[i]`."""
        batch = len(token_ids)
        size, width = self.load(token_ids, positions, slot_mapping, block_tables, state_slots)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.graph_logits[size][:batch]
        meta = self.model.ops.prepare_step(self._meta(size, max(positions) + 1, width), self.model.cos_sin, self.block_size)
        return self.model.forward(self.token_ids[:size], meta, self.k_caches, self.v_caches, self.states)[:batch]

    def load(
        self, token_ids: list[int], positions: list[int], slot_mapping: list[int], block_tables: list[list[int]],
        state_slots: list[int] = (),
    ) -> tuple[int, int]:
        """Copy one decode step's inputs into the static buffers, padded rows after them; returns (the padded
        size, the widest block table)."""
        batch = len(token_ids)
        size = self.padded_size(batch)
        assert size is not None, f"a decode batch of {batch} rows is larger than the static buffers"
        width = max(len(t) for t in block_tables)
        assert width <= self.max_blocks_per_seq
        device = self.token_ids.device
        host = torch.tensor([token_ids, positions, slot_mapping, [p + 1 for p in positions]], dtype=torch.long)
        rows = torch.tensor([t + [self.scratch_block] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        host, rows = host.to(device, non_blocking=True), rows.to(device, non_blocking=True)
        self.token_ids[:batch].copy_(host[0])
        self.positions[:batch].copy_(host[1])
        self.slot_mapping[:batch].copy_(host[2])
        self.seq_lens[:batch].copy_(host[3])
        self.block_tables[:batch, :width].copy_(rows)
        if self.states:
            self.state_slots[:batch].copy_(torch.tensor(state_slots, dtype=torch.long).to(device, non_blocking=True))
            self.state_slots[batch:size].fill_(self.scratch_state_slot)
        # padded rows: one token at position 0 of the scratch block
        self.positions[batch:size].zero_()
        self.slot_mapping[batch:size].fill_(self.scratch_slot)
        self.seq_lens[batch:size].fill_(1)
        self.block_tables[batch:size].fill_(self.scratch_block)
        return size, width
