"""`CpuOps`: the CPU fast path: `TorchOps` with the matmuls, norms, rotary, attention and SwiGLU in the C kernels
of `gpullama.kernels.cpu_native`; the weights stay quantized (`gpullama.ops.cpu_weights`), activations float32.

Each kernel computes a row on its own in a fixed order, so a request's tokens are the same alone or batched;
weights are dequantized exactly, so the results differ from the exact float32 path only by the order of the
sums (about 1e-6 relative).
"""

from __future__ import annotations

import torch

from gpullama.kernels import cpu_native
from gpullama.ops.cpu_weights import CpuWeight, packable
from gpullama.ops.metadata import BatchMetadata
from gpullama.ops.torch_ops import TorchOps
from gpullama.quants import QTensor


class CpuOps(TorchOps):
    """The CPU ops of the fast path; built only where `cpu_native.library()` is available."""

    name = "cpu"

    def __init__(self, device: torch.device):
        assert device.type == "cpu" and cpu_native.library() is not None
        super().__init__(device, torch.float32)

    @property
    def mode(self) -> str:
        """What the matmuls run on, for logs and benchmark labels."""
        return f"quantized weights, native kernels ({cpu_native.isa()}), float32 activations"

    def prepare_weight(self, weight: QTensor) -> torch.Tensor | CpuWeight:
        """The matrix in its CPU weight format (dense float32 for a shape the kernels do not take)."""
        return CpuWeight.from_qtensor(weight) if packable(weight) else super().prepare_weight(weight)

    def prepare_step(self, meta: BatchMetadata, cos_sin: torch.Tensor, block_size: int) -> BatchMetadata:
        """The kernels read the metadata as it is."""
        return meta

    def linear(self, x: torch.Tensor, weight: torch.Tensor | CpuWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, float32."""
        if not isinstance(weight, CpuWeight):
            return super().linear(x, weight, bias)
        out = weight.matmul(x if x.is_contiguous() else x.contiguous())
        return out if bias is None else out.add_(bias)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual) * weight, x + residual)``; the sum is written over `x` (a step's fresh activations)."""
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            return super().rms_norm(x, weight, eps, residual)
        return cpu_native.rms_norm(x, residual, weight, eps, torch.empty_like(x)), x

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
        """Rotate q and k in place and write k, v to the pool."""
        cpu_native.rope_and_cache(q, k, v, cos_sin, meta.positions, meta.slot_mapping, k_cache, v_cache)
        return q, k

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its context in the paged pool: ``[T, Hq, D]``."""
        d = q.shape[-1]
        if d % 16 or d > cpu_native.MAX_HEAD_DIM:
            return super().attention(q, k_cache, v_cache, meta, scale)
        out = q.new_empty(q.shape)
        return cpu_native.attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                    scale, out)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``silu(gate) * up`` where `gate_up` is ``[T, 2 * I]`` (gate first)."""
        return cpu_native.silu_mul(gate_up, gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))
