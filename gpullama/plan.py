"""The step plan: built once per model load, it runs each engine step's forward.

Decode steps (one new token per sequence, every row sampling) run on static buffers padded to the
smallest of a ladder of batch sizes; on CUDA with the Triton ops each size is captured once as a CUDA
graph and replayed, so a decode step launches no kernel from Python and allocates nothing. Prefill and
mixed steps run eagerly. Padded rows write their k/v into a reserved scratch block and are dropped.
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


class StepPlan:
    """Static decode buffers (and CUDA graphs) for one model and its KV pool."""

    def __init__(
        self,
        model: Decoder,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        use_static_decode: bool,
        use_graphs: bool,
    ):
        self.model = model
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.use_static_decode = use_static_decode or use_graphs
        self.use_graphs = use_graphs
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}
        if not self.use_static_decode:
            return
        device = model.ops.device
        n, block_size = max_num_seqs, k_caches[0].shape[1]
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.token_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=device)
        if use_graphs:
            self._capture()

    def _static_meta(self, size: int, seq_lens_cpu: list[int]) -> BatchMetadata:
        """Views of the static buffers for a padded batch of `size` rows."""
        return BatchMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            logits_indices=self.logits_indices[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=1,
        )

    def _capture(self) -> None:
        """Capture one decode graph per batch size (largest first, sharing one memory pool)."""
        pool = None
        max_len = self.block_tables.shape[1] * self.block_size
        for size in reversed(self.batch_sizes):
            meta = self._static_meta(size, [max_len] * size)
            for _ in range(2):  # compile the kernels and settle the allocator outside the capture
                self.model.forward(self.token_ids[:size], meta, self.k_caches, self.v_caches)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.forward(self.token_ids[:size], meta, self.k_caches, self.v_caches)
            pool = graph.pool()
            self.graphs[size] = graph
            self.graph_logits[size] = logits
        log.info("captured decode graphs for batch sizes %s", self.batch_sizes)

    def _padded_size(self, batch: int) -> int | None:
        return next((s for s in self.batch_sizes if s >= batch), None)

    def run(self, token_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """Logits of `meta.logits_indices` for one step: a replayed graph for decode, an eager forward otherwise."""
        batch = len(meta.seq_lens_cpu)
        is_decode = meta.max_query_len == 1 and meta.logits_indices.shape[0] == token_ids.shape[0] == batch
        size = self._padded_size(batch) if self.use_static_decode and is_decode else None
        if size is None or meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return self.model.forward(token_ids, meta, self.k_caches, self.v_caches)
        self.token_ids[:batch].copy_(token_ids)
        self.positions[:batch].copy_(meta.positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        # padded rows: one token at position 0 of the scratch block
        self.positions[batch:size].zero_()
        self.slot_mapping[batch:size].fill_(self.scratch_slot)
        self.seq_lens[batch:size].fill_(1)
        self.block_tables[batch:size].fill_(self.scratch_block)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.graph_logits[size][:batch]
        static = self._static_meta(size, meta.seq_lens_cpu + [1] * (size - batch))
        static.block_tables = self.block_tables[:size, :width]
        return self.model.forward(self.token_ids[:size], static, self.k_caches, self.v_caches)[:batch]
