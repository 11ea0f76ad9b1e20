"""`TritonOps`: `TorchOps` with each op replaced by a fused Triton kernel; quantized weights stay GGUF blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpullama.kernels.attention import paged_attention
from gpullama.kernels.delta_rule import gated_delta_rule as _gated_delta_rule
from gpullama.kernels.embedding import embedding as _embedding
from gpullama.kernels.fused_moe import fused_moe
from gpullama.kernels.gelu import gelu as _gelu
from gpullama.kernels.gguf_blocks import QUANTIZED_KERNEL_TYPES
from gpullama.kernels.layer_norm import layer_norm as _layer_norm
from gpullama.kernels.quant_matmul import quant_linear
from gpullama.kernels.rms_norm import head_rms_norm as _head_rms_norm
from gpullama.kernels.rms_norm import rms_norm as _rms_norm
from gpullama.kernels.rotary import rope_and_cache as _rope_and_cache
from gpullama.kernels.sampling import sample as _sample
from gpullama.kernels.short_conv import short_conv as _short_conv
from gpullama.kernels.silu_mul import gelu_tanh_mul as _gelu_tanh_mul
from gpullama.kernels.silu_mul import silu_mul as _silu_mul
from gpullama.kernels.soft_cap import soft_cap as _soft_cap
from gpullama.kernels.ssm_scan import ssm_scan as _ssm_scan
from gpullama.ops.experts import Experts
from gpullama.ops.metadata import BatchMetadata, rope_source
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

    def prepare_experts(
        self, gate_up: list[QTensor], down: QTensor, gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
    ) -> Experts:
        """The stacked experts as raw GGUF blocks on the device (gate and up rows of each expert joined) for
        `fused_moe`; types the kernels do not read get `TorchOps`' dense experts."""
        readable = {p.qtype for p in gate_up} | {down.qtype}
        if len({p.qtype for p in gate_up}) != 1 or not all(
            t in QUANTIZED_KERNEL_TYPES or t.name in _DENSE_TYPES for t in readable
        ):
            return super().prepare_experts(gate_up, down, gate_up_bias, down_bias, activation, alpha, limit)
        data = torch.cat([p.data.to(self.device) for p in gate_up], dim=1)
        e, rows, hidden = gate_up[0].shape[0], sum(p.shape[1] for p in gate_up), gate_up[0].shape[2]
        joined = QTensor(data, gate_up[0].qtype, (e, rows, hidden), gate_up[0].name)

        def bias(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=self.device, dtype=torch.float32).contiguous()

        return Experts(joined, down.to(self.device), bias(gate_up_bias), bias(down_bias), e, rows // 2, hidden,
                       activation, alpha, limit)

    def moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
        """The MoE block by two grouped GEMMs over the pairs sorted by expert (`gpullama.kernels.fused_moe`)."""
        if not isinstance(experts.gate_up, QTensor):
            return super().moe(x, ids, weights, experts)
        return fused_moe(x, ids, weights, experts.gate_up, experts.down, experts.gate_up_bias, experts.down_bias,
                         experts.activation, experts.alpha, experts.limit, self.dtype)

    def prepare_step(self, meta: BatchMetadata, cos_sin: torch.Tensor, block_size: int) -> BatchMetadata:
        """The kernels read the metadata as it is (rotary rows and context spans are looked up inside them)."""
        return meta

    def prepare_rope(self, meta: BatchMetadata, cos_sin: torch.Tensor) -> BatchMetadata:
        """The rotary kernel reads each table's rows itself."""
        return meta

    def embedding(self, ids: torch.Tensor, table: QTensor | torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Rows of the table for `ids` times `scale`, dequantized in the kernel: float32 ``[T, H]``."""
        if isinstance(table, QTensor) and table.qtype not in QUANTIZED_KERNEL_TYPES and table.qtype.name not in _DENSE_TYPES:
            return super().embedding(ids, table, scale)
        return _embedding(ids, table, scale=scale)

    def linear(self, x: torch.Tensor, weight: QTensor | torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` from GGUF blocks, multiplied in the compute dtype, float32 out."""
        return quant_linear(x, weight, bias, self.dtype)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        x_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm fused with the residual add: ``(norm(x * x_scale + residual) * weight, x * x_scale + residual)``."""
        return _rms_norm(x, weight, eps, residual, x_scale)

    def post_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of a block's output (Gemma), float32: the fused kernel without a residual."""
        return _rms_norm(x, weight, eps)[0]

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head of ``[T, heads, D]``."""
        return _head_rms_norm(x, weight, eps)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        """LayerNorm with weight and bias (the vision towers'), float32 ``[T, H]``."""
        return _layer_norm(x, weight, bias, eps)

    def gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """GELU (``none``: erf, ``tanh``, ``quick``) of ``[T, N]``, float32."""
        return _gelu(x.contiguous(), approximate)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k **in place** by row t of `cos_sin` each: the rotary kernel with row t's own table row and
        no pool write (every slot negative)."""
        t, hk, d = k.shape
        rows = torch.arange(t, device=q.device)
        skip = torch.full((t,), -1, dtype=torch.int64, device=q.device)
        pool = torch.empty((1, 1, hk, d), dtype=torch.float32, device=q.device)  # never written
        return _rope_and_cache(q, k, None, cos_sin, rows, skip, pool, None)

    def image_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
        """torch's `scaled_dot_product_attention` with q, k, v in the compute dtype (FlashAttention or cuDNN in
        bfloat16 on CUDA; the memory-efficient kernel with a window mask or in float32), float32 out: no Triton
        kernel of ours, see docs/kernels.md, "Vision towers"."""
        q, k, v = (x.to(self.dtype) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).float()

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
        return _rope_and_cache(q, k, v, *rope_source(meta, cos_sin), meta.slot_mapping, k_cache, v_cache)

    def short_conv(
        self, x: torch.Tensor, kernel: torch.Tensor, states: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """LFM2's short convolution over each sequence's rows and its state slot, one kernel launch."""
        return _short_conv(x, kernel, states, meta.state_slots, meta.positions, meta.query_start_loc)

    def gated_delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
        states: torch.Tensor, meta: BatchMetadata,
    ) -> torch.Tensor:
        """The gated delta rule over each sequence's rows and its state slot, one kernel launch (the recurrent form
        for prefill too: see `gpullama.kernels.delta_rule`)."""
        return _gated_delta_rule(q, k, v, decay, beta, states, meta.state_slots, meta.positions, meta.query_start_loc)

    def ssm_scan(
        self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        states: torch.Tensor, meta: BatchMetadata,
    ) -> torch.Tensor:
        """Mamba2's selective scan over each sequence's rows and its state slot, one kernel launch (the recurrent
        form for prefill too: see `gpullama.kernels.ssm_scan`)."""
        return _ssm_scan(x, dt, a, b, c, states, meta.state_slots, meta.positions, meta.query_start_loc)

    def latent_rope_and_cache(
        self, q: torch.Tensor, rows: torch.Tensor, cos_sin: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """Rotate the queries and the latent rows in place and write the rows into the latent pool: the rotary
        kernel without its value write."""
        return _rope_and_cache(q, rows, None, cos_sin, meta.positions, meta.slot_mapping, cache, None)[0]

    def latent_attention(
        self, q: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float, value_start: int
    ) -> torch.Tensor:
        """Attention over the latent pool: the paged attention kernels with the pool as both keys and values (one
        kv head for every query head), the latent part of the output kept."""
        return paged_attention(
            q, cache, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale,
        )[..., value_start:]

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Paged attention: split-K decode when every sequence adds one token, else varlen causal prefill (a
        sliding window, soft-capping and attention sinks when given)."""
        return paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale,
            window=window, softcap=softcap, sinks=sinks,
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the fused gate|up output."""
        return _silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU of the fused gate|up output."""
        return _gelu_tanh_mul(gate_up)

    def soft_cap(self, x: torch.Tensor, cap: float, scale: float = 1.0) -> torch.Tensor:
        """Final logits times `scale`, soft-capped at `cap` when > 0."""
        return _soft_cap(x, cap, scale)

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
