"""Tensor-parallel shards of a GGUF model's weights, cut in their stored block form (the Megatron layout).

Rank r of N holds:
- column-parallel q/k/v and gate/up: the output rows of its attention heads (q heads ``r * Hq/N`` on, and the KV
  heads they read; with fewer KV heads than ranks each KV head is held by the ``N / Hk`` ranks of its q heads, as
  vLLM does) and of its slice ``r * I/N`` on of the MLP; a fused tensor (Phi-3's ``attn_qkv``, its ``ffn_up`` holding
  gate then up) is cut part by part;
- row-parallel o and down: the matching input columns, in whole quant blocks (the partial products are summed by
  one all-reduce after each);
- the embedding and the output head: a slice of the vocabulary (padded with zero rows to ``N`` equal slices, as
  vLLM pads it); the logits are gathered to rank 0;
- everything else (norms, rope factors) whole.

Every cut is a view of the file's rows or a copy of whole blocks, made before `ops.prepare_weight`, so each rank
reads and prepares only its own part, whatever the backend makes of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gpullama.config import ModelConfig
from gpullama.quants import QTensor, block_size

_LAYER_TENSOR = re.compile(r"blk\.\d+\.(.+)")


@dataclass(frozen=True)
class ShardPlan:
    """Which part of each weight rank `rank` of `world_size` holds, and the per-rank sizes the forward runs with."""

    config: ModelConfig
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        c, n = self.config, self.world_size
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {n}")
        arch = c.architecture
        if c.num_heads % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the {c.num_heads} attention heads "
                f"('{arch}.attention.head_count', tensor blk.0.attn_q.weight)"
            )
        kv = c.num_kv_heads
        if (kv >= n and kv % n) or (kv < n and n % kv):
            raise ValueError(
                f"tensor_parallel_size {n} and the {kv} KV heads ('{arch}.attention.head_count_kv', tensor "
                f"blk.0.attn_k.weight) do not divide one another (each rank needs whole KV heads)"
            )
        if c.intermediate_size % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the MLP's {c.intermediate_size} rows "
                f"('{arch}.feed_forward_length', tensor blk.0.ffn_up.weight)"
            )

    # -- per-rank sizes -----------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        """Query heads of this rank."""
        return self.config.num_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        """KV heads of this rank (1 where several ranks hold the same one)."""
        return max(1, self.config.num_kv_heads // self.world_size)

    @property
    def intermediate_size(self) -> int:
        """MLP rows of this rank."""
        return self.config.intermediate_size // self.world_size

    def vocab_rows(self, vocab: int) -> int:
        """Rows of the embedding and output head each rank holds (the vocabulary padded to N equal slices)."""
        return -(-vocab // self.world_size)

    def vocab_start(self, vocab: int) -> int:
        """First token id of this rank's vocabulary slice."""
        return self.rank * self.vocab_rows(vocab)

    # -- cuts -----------------------------------------------------------------------------------------
    def _head_rows(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Row spans (q, k/v) of this rank's heads in a q and in a k or v projection."""
        c, d = self.config, self.config.head_dim
        q0 = self.rank * self.num_heads
        # the KV head(s) of this rank's q heads: with fewer KV heads than ranks, several ranks share one
        k0 = q0 * c.num_kv_heads // c.num_heads
        return (q0 * d, (q0 + self.num_heads) * d), (k0 * d, (k0 + self.num_kv_heads) * d)

    def _rows(self, name: str, rows: int) -> list[tuple[int, int]] | None:
        """Row spans of a column-parallel tensor this rank holds (concatenated), None when it is not one."""
        c = self.config
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            return None
        part = match.group(1).rsplit(".", 1)[0]
        q, kv = self._head_rows()
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        i0 = self.rank * self.intermediate_size
        mlp = (i0, i0 + self.intermediate_size)
        spans = {
            "attn_q": ([q], q_rows),
            "attn_k": ([kv], kv_rows),
            "attn_v": ([kv], kv_rows),
            "attn_qkv": ([q, _shift(kv, q_rows), _shift(kv, q_rows + kv_rows)], q_rows + 2 * kv_rows),
            "ffn_gate": ([mlp], c.intermediate_size),
        }
        if part == "ffn_up":  # Phi-3 stores gate and up in one ffn_up of 2 I rows
            fused = rows == 2 * c.intermediate_size
            spans[part] = ([mlp, _shift(mlp, c.intermediate_size)] if fused else [mlp], rows if fused else
                           c.intermediate_size)
        if part not in spans:
            return None
        cut, expected = spans[part]
        if rows != expected:
            raise ValueError(f"tensor {name!r} has {rows} rows; the model's head and MLP sizes make {expected}")
        return cut

    def _cols(self, name: str, cols: int) -> tuple[int, int] | None:
        """The column span of a row-parallel tensor this rank holds, None when it is not one."""
        c = self.config
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            return None
        part = match.group(1)
        if part == "attn_output.weight":
            span, expected = self._head_rows()[0], c.num_heads * c.head_dim
        elif part == "ffn_down.weight":
            i0 = self.rank * self.intermediate_size
            span, expected = (i0, i0 + self.intermediate_size), c.intermediate_size
        else:
            return None
        if cols != expected:
            raise ValueError(f"tensor {name!r} has {cols} columns; the model's head and MLP sizes make {expected}")
        return span

    def local(self, name: str, tensor: QTensor) -> QTensor:
        """This rank's part of the weight `name` (the tensor itself when there is one rank, or it is replicated)."""
        if self.world_size == 1:
            return tensor
        if name in ("token_embd.weight", "output.weight"):
            vocab = tensor.shape[0]
            start = self.vocab_start(vocab)
            rows = tensor.slice_rows(min(start, vocab), min(start + self.vocab_rows(vocab), vocab))
            return rows.pad_rows(self.vocab_rows(vocab))
        cols = self._cols(name, tensor.shape[-1]) if len(tensor.shape) == 2 else None
        if cols is not None:
            return tensor.slice_cols(*cols)
        spans = self._rows(name, tensor.shape[0])
        if spans is None:
            return tensor
        parts = [tensor.slice_rows(*span) for span in spans]
        return parts[0] if len(parts) == 1 else _concat_rows(parts)

    def check(self, tensors: dict[str, QTensor]) -> None:
        """Raise ValueError naming the first tensor this plan cannot cut (a column span that splits a quant block,
        rows that disagree with the config), without reading or copying any weight."""
        if self.world_size == 1:
            return
        for name, tensor in tensors.items():
            if len(tensor.shape) == 2 and (span := self._cols(name, tensor.shape[-1])) is not None:
                bs = block_size(tensor.qtype)
                if span[0] % bs or span[1] % bs:
                    raise ValueError(
                        f"tensor_parallel_size {self.world_size} splits the {tensor.shape[-1]} columns of {name!r} "
                        f"at {span[1] - span[0]}, which cuts its {tensor.qtype.name} blocks of {bs} values"
                    )
            else:
                self._rows(name, tensor.shape[0])


def _shift(span: tuple[int, int], offset: int) -> tuple[int, int]:
    return span[0] + offset, span[1] + offset


def _concat_rows(parts: list[QTensor]) -> QTensor:
    """Stack row slices of one tensor (same type and row width) into a new tensor."""
    first = parts[0]
    data = torch.cat([p.data for p in parts], dim=0)
    return QTensor(data, first.qtype, (sum(p.shape[0] for p in parts), *first.shape[1:]), first.name)
