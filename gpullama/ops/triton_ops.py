"""`TritonOps`: `TorchOps` with each op replaced by a fused Triton kernel; quantized weights stay GGUF blocks."""

from __future__ import annotations

import torch

from gpullama.kernels.attention import paged_attention
from gpullama.kernels.embedding import embedding as _embedding
from gpullama.kernels.gguf_blocks import QUANTIZED_KERNEL_TYPES
from gpullama.kernels.quant_matmul import quant_linear
from gpullama.kernels.rms_norm import head_rms_norm as _head_rms_norm
from gpullama.kernels.rms_norm import rms_norm as _rms_norm
from gpullama.kernels.rotary import rope_and_cache as _rope_and_cache
from gpullama.kernels.sampling import sample as _sample
from gpullama.kernels.silu_mul import silu_mul as _silu_mul
from gpullama.ops.metadata import BatchMetadata
from gpullama.ops.torch_ops import TorchOps
from gpullama.quants import QTensor

_DENSE_TYPES = ("F32", "F16", "BF16")


class TritonOps(TorchOps):
    """Every op of `TorchOps` as a Triton kernel; quantized weights stay as raw GGUF blocks on the device."""

    name = "triton"
    supports_cuda_graphs = True  # every kernel launch reads its sizes from tensors or from the static batch shape

    def prepare_weight(self, weight: QTensor) -> QTensor | torch.Tensor:
        """Raw blocks on the device for kernel-readable types, the F16/BF16/F32 matrix as stored, else dense."""
        if weight.qtype in QUANTIZED_KERNEL_TYPES or weight.qtype.name in _DENSE_TYPES:
            return weight.to(self.device)
        return super().prepare_weight(weight)

    def prepare_step(self, meta: BatchMetadata, cos_sin: torch.Tensor, block_size: int) -> BatchMetadata:
        """The kernels read the metadata as it is (rotary rows and context spans are looked up inside them)."""
        return meta

    def embedding(self, ids: torch.Tensor, table: QTensor | torch.Tensor) -> torch.Tensor:
        """Rows of the table for `ids`, dequantized in the kernel: float32 ``[T, H]``."""
        if isinstance(table, QTensor) and table.qtype not in QUANTIZED_KERNEL_TYPES and table.qtype.name not in _DENSE_TYPES:
            return super().embedding(ids, table)
        return _embedding(ids, table)

    def linear(self, x: torch.Tensor, weight: QTensor | torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` from GGUF blocks, multiplied in the compute dtype, float32 out."""
        return quant_linear(x, weight, bias, self.dtype)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm fused with the residual add: ``(norm(x + residual) * weight, x + residual)``."""
        return _rms_norm(x, weight, eps, residual)

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head of ``[T, heads, D]``."""
        return _head_rms_norm(x, weight, eps)

    def rope_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: BatchMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place and write k, v into the paged pool, in one kernel."""
        return _rope_and_cache(q, k, v, cos_sin, meta.positions, meta.slot_mapping, k_cache, v_cache)

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMetadata, scale: float
    ) -> torch.Tensor:
        """Paged attention: split-K decode when every sequence adds one token, else varlen causal prefill."""
        return paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the fused gate|up output."""
        return _silu_mul(gate_up)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """Next token per row on the device (see `gpullama.kernels.sampling.sample`)."""
        return _sample(logits, temperature, top_k, top_p, min_p, uniform)
