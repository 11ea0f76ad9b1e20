"""Random ragged batches over a shuffled paged KV pool, shared by the attention and rope tests."""

from __future__ import annotations

import torch

from gpullama.ops import BatchMetadata


def make_batch(
    seq_lens: list[int], q_lens: list[int], block_size: int, num_blocks: int, seed: int = 0
) -> BatchMetadata:
    """Metadata of sequences whose last `q_lens[i]` of `seq_lens[i]` tokens are new, on randomly placed blocks."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    positions, slots, starts = [], [], [0]
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        n = -(-seq_len // block_size)
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        for p in range(seq_len - q_len, seq_len):
            positions.append(p)
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
        starts.append(starts[-1] + q_len)
    return BatchMetadata(
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        logits_indices=torch.tensor(starts[1:], dtype=torch.int64) - 1,
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def meta_to(meta: BatchMetadata, device: torch.device) -> BatchMetadata:
    """The same metadata with its tensors on `device`."""
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}
    return BatchMetadata(**fields)
