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
- mixture of experts: every expert cut as a dense MLP (each rank holds rows ``r * I/N`` on of every expert's
  gate and up, the matching columns of its down; the shared expert likewise), so each rank runs the same routing
  (router replicated) over its slice of every chosen expert and one all-reduce sums them;
- biases added after a row-parallel matrix (attention output, down: gpt-oss) only on rank 0, zeros elsewhere, so
  the all-reduce adds them once; attention sinks per head, with the heads;
- everything else (norms, rope factors, routers) whole.

Multi-head latent attention (deepseek2) and recurrent layers (lfm2's short convolutions, qwen35's gated delta-nets)
are refused for more than one rank (the former's one latent row a token serves every head, so a split by heads would
repeat the whole cache on each rank; the latter's per-sequence states are not split yet).

Every cut is a view of the file's rows or a copy of whole blocks, made before `ops.prepare_weight`, so each rank
reads and prepares only its own part, whatever the backend makes of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gpullama.config import ModelConfig
from gpullama.quants import QTensor, block_size, concat_rows

_LAYER_TENSOR = re.compile(r"blk\.\d+\.(.+)")
_ONCE = ("attn_output.bias", "ffn_down.bias", "ffn_down_exps.bias", "ffn_down_shexp.bias")
"""Biases added after a row-parallel matmul: held by rank 0 (zeros on the others)."""


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
        if c.is_mla and n > 1:
            raise ValueError(
                f"tensor_parallel_size {n}: multi-head latent attention ('{arch}.attention.kv_lora_rank') is not split "
                f"over ranks (its latent cache row is shared by every head); run {arch} with tensor_parallel_size 1"
            )
        if c.has_recurrent_state and n > 1:
            raise ValueError(
                f"tensor_parallel_size {n}: the recurrent layers of {arch} ({c.recurrent_layers_named}) keep per-sequence "
                f"states that are not split over ranks; run {arch} with tensor_parallel_size 1"
            )
        if (c.head_dim_swa or c.per_layer_input_size or c.kv_shared_layers) and n > 1:
            raise ValueError(
                f"tensor_parallel_size {n}: Gemma 4's layers of two head sizes, shared K/V and per-layer embeddings "
                f"are not split over ranks; run {arch} with tensor_parallel_size 1"
            )
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
        if c.is_moe:
            for size, key in ((c.expert_intermediate_size, "expert_feed_forward_length"),
                              (c.shared_expert_intermediate_size, "expert_shared_feed_forward_length")):
                if size % n:
                    raise ValueError(
                        f"tensor_parallel_size {n} does not divide each expert's {size} rows ('{arch}.{key}', "
                        f"tensor blk.0.ffn_gate_exps.weight)"
                    )
        elif c.intermediate_size % n:
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

    def _slice(self, size: int) -> tuple[int, int]:
        """This rank's span of `size` rows cut in N equal parts."""
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

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
        shared = self._slice(c.shared_expert_intermediate_size)
        heads = (self.rank * self.num_heads, (self.rank + 1) * self.num_heads)
        spans = {
            "attn_sinks": ([heads], c.num_heads),
            "ffn_gate_shexp": ([shared], c.shared_expert_intermediate_size),
            "ffn_up_shexp": ([shared], c.shared_expert_intermediate_size),
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
        elif part == "ffn_down_shexp.weight":
            span, expected = self._slice(c.shared_expert_intermediate_size), c.shared_expert_intermediate_size
        elif part in ("ffn_down_exps.weight", "ffn_gate_exps.bias", "ffn_up_exps.bias"):
            span, expected = self._slice(c.expert_intermediate_size), c.expert_intermediate_size
        else:
            return None
        if cols != expected:
            raise ValueError(f"tensor {name!r} has {cols} columns; the model's head and MLP sizes make {expected}")
        return span

    def _expert_rows(self, name: str, rows: int) -> list[tuple[int, int]] | None:
        """Spans along the expert rows (dim 1 of ``[E, rows, K]``, or the last dim of a gate|up bias ``[E, 2I]``) of
        a fused gate|up expert tensor, None when `name` is not one."""
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None or match.group(1) not in ("ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                   "ffn_gate_up_exps.weight", "ffn_gate_up_exps.bias"):
            return None
        size = self.config.expert_intermediate_size
        span = self._slice(size)
        fused = match.group(1).startswith("ffn_gate_up_exps")
        expected = 2 * size if fused else size
        if rows != expected:
            raise ValueError(f"tensor {name!r} has {rows} expert rows; the expert size makes {expected}")
        return [span, _shift(span, size)] if fused else [span]

    def local(self, name: str, tensor: QTensor) -> QTensor:
        """This rank's part of the weight `name` (the tensor itself when there is one rank, or it is replicated)."""
        if self.world_size == 1:
            return tensor
        if name.endswith(_ONCE):  # added after a row-parallel matmul: once, by rank 0
            return tensor if self.rank == 0 else QTensor(torch.zeros_like(tensor.data), tensor.qtype, tensor.shape,
                                                         tensor.name)
        if len(tensor.shape) >= 2:
            dim = 1 if len(tensor.shape) == 3 else len(tensor.shape) - 1
            expert = self._expert_rows(name, tensor.shape[dim])
            if expert is not None:
                if dim == len(tensor.shape) - 1:  # a bias [E, 2I]: float columns
                    parts = [tensor.slice_cols(*span) for span in expert]
                    return parts[0] if len(parts) == 1 else QTensor(
                        torch.cat([p.data for p in parts], dim=-1), tensor.qtype,
                        (*tensor.shape[:-1], sum(p.shape[-1] for p in parts)), tensor.name)
                data = torch.cat([tensor.data[:, a:b] for a, b in expert], dim=1).contiguous()
                return QTensor(data, tensor.qtype, (tensor.shape[0], data.shape[1], tensor.shape[2]), tensor.name)
        if name in ("token_embd.weight", "output.weight"):
            vocab = tensor.shape[0]
            start = self.vocab_start(vocab)
            rows = tensor.slice_rows(min(start, vocab), min(start + self.vocab_rows(vocab), vocab))
            return rows.pad_rows(self.vocab_rows(vocab))
        cols = self._cols(name, tensor.shape[-1]) if len(tensor.shape) >= 2 else None
        if cols is not None:
            return tensor.slice_cols(*cols)
        spans = self._rows(name, tensor.shape[0])
        if spans is None:
            return tensor
        parts = [tensor.slice_rows(*span) for span in spans]
        return parts[0] if len(parts) == 1 else concat_rows(parts)

    def check(self, tensors: dict[str, QTensor]) -> None:
        """Raise ValueError naming the first tensor this plan cannot cut (a column span that splits a quant block,
        rows that disagree with the config), without reading or copying any weight."""
        if self.world_size == 1:
            return
        for name, tensor in tensors.items():
            if len(tensor.shape) >= 2 and self._expert_rows(name, tensor.shape[1 if len(tensor.shape) == 3 else -1]):
                continue
            if len(tensor.shape) >= 2 and (span := self._cols(name, tensor.shape[-1])) is not None:
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
