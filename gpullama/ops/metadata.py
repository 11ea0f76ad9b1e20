"""Where each token of a ragged batch sits: the metadata every op of one step reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoraGroup:
    """The rows of one step that use one LoRA adapter (a `gpullama.lora.Adapter`), each with its scale; a row with
    several adapters is in several groups. `out_rows`/`out_scales`: the same for the rows of the logits."""

    adapter: Any
    rows: torch.Tensor  # [R] int64 token rows
    scales: torch.Tensor  # [R] float32
    out_rows: torch.Tensor  # [S'] int64 rows of the logits (positions in `logits_indices`)
    out_scales: torch.Tensor  # [S'] float32


@dataclass
class BatchMetadata:
    """Positions, KV slots, per-sequence spans and block tables of one step's ragged batch (built by the model
    runner, read by the ops; nothing below the runner derives more from it than it says)."""

    positions: torch.Tensor  # [T] int64: absolute position of each token
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset where its k/v are written
    query_start_loc: torch.Tensor  # [B + 1] int32: token span of each sequence in the batch
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32: block ids of each sequence, padded
    logits_indices: torch.Tensor  # [S] int64: rows whose logits are wanted
    max_query_len: int  # 1 for a decode batch (every sequence adds one token)
    max_seq_len: int  # the longest context in the batch (an upper bound on a padded decode batch)
    # host copies for the torch path's per-sequence prefill loop; None on decode batches, which never loop
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # derived once per step by `ops.prepare_step` (the runner calls it) for the ops that read them; None otherwise
    rope_cos: torch.Tensor | None = None  # [T, 1, D] cos of each token's rotary angles, for both halves
    rope_sin: torch.Tensor | None = None  # [T, 1, D] sin of them, first half negated
    context_slots: torch.Tensor | None = None  # decode: [B, max_seq_len] int64 pool row of each context position
    context_mask: torch.Tensor | None = None  # decode: [B, 1, 1, max_seq_len] bool, True inside each context
    # embedding rows (rank 0): the rows whose final hidden states are pooled, and the pool each is summed into
    pool_indices: torch.Tensor | None = None  # [P] int64 token rows
    pool_segments: torch.Tensor | None = None  # [P] int64 pool of each row, in [0, num_pools)
    num_pools: int = 0
    # recurrent layers (LFM2's short convolutions): each sequence's state slot in their `states` tensors
    state_slots: torch.Tensor | None = None  # [B] int64
    # images (the model runner's `_image_attention`): rows whose input embeddings replace the token embeddings
    # ((rows [R] int64, embeddings [R, H] float32)), and the image rows with the decode-shaped metadata over which
    # they attend again, to every key of their image (not causally)
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    image_attention: tuple[torch.Tensor, BatchMetadata] | None = None
    # M-RoPE (Qwen2-VL's images): each row's own cos|sin row ``[T, R]`` (its frequencies turned by the positions of
    # their axes) and the row each token reads, arange(T); every op's rotary reads these in place of the model's
    # table at `positions` (`rope_source`)
    rope_table: torch.Tensor | None = None
    rope_index: torch.Tensor | None = None
    # LoRA adapters of the step's rows, one group an adapter (None: no row has one)
    lora: list[LoraGroup] | None = None

    @property
    def is_decode(self) -> bool:
        """True when every sequence of the batch computes exactly one new token."""
        return self.max_query_len == 1


def rope_source(meta: BatchMetadata, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary table and the row of it each token reads: `meta.rope_table` row by row (M-RoPE), else `cos_sin`
    at the tokens' positions."""
    if meta.rope_table is not None:
        return meta.rope_table, meta.rope_index
    return cos_sin, meta.positions
