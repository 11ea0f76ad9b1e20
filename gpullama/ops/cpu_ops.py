"""`CpuOps`: the CPU fast path: `TorchOps` with the matmuls, norms, rotary (partial too), attention (sliding
windows and soft-capping too), SwiGLU, GeGLU and the final soft cap in the C kernels of
`gpullama.kernels.cpu_native`; the weights stay quantized (`gpullama.ops.cpu_weights`), activations float32.
Shapes the kernels do not take (a head dim not a multiple of 16, a matrix row not a multiple of 32 values) run
`TorchOps`' op instead.

Each kernel computes a row on its own in a fixed order, so a request's tokens are the same alone or batched;
weights are dequantized exactly, and the matmuls see each 32 activations as 16-bit integers (to 1 part in 64516 of
their largest magnitude), so logits differ from the exact float32 path by about 3e-4 of the largest one.
"""

from __future__ import annotations

from typing import Any

import torch

from gpullama.kernels import cpu_native
from gpullama.ops.cpu_stack import NativeStack
from gpullama.ops.cpu_weights import NATIVE_FORMATS, CpuExperts, CpuWeight, packable, packable_experts
from gpullama.ops.experts import Experts
from gpullama.ops.metadata import BatchMetadata, rope_source
from gpullama.ops.torch_ops import TorchOps
from gpullama.quants import QTensor


class CpuOps(TorchOps):
    """The CPU ops of the fast path; built only where `cpu_native.library()` is available."""

    name = "cpu"

    def __init__(self, device: torch.device, activation_bits: int = 16):
        assert device.type == "cpu" and cpu_native.library() is not None
        assert activation_bits in cpu_native.ACTIVATION_BITS
        super().__init__(device, torch.float32)
        self.activation_bits = activation_bits  # the quantized matmuls' activation integers (`cpu_native.matmul`)
        # packed embedding tables, so that a tied output head shares the table's copy
        self._tables: dict[tuple, CpuWeight] = {}

    @property
    def mode(self) -> str:
        """What the matmuls run on, for logs and benchmark labels."""
        eight = ", 8-bit in the matmuls" if self.activation_bits == 8 else ""
        return f"quantized weights, native kernels ({cpu_native.isa()}), float32 activations{eight}"

    def kv_cache_dtype(self, name: str, head_dim: int, block_size: int, latent: bool = False) -> torch.dtype:
        """The KV pool's dtype for `kv_cache_dtype` `name`: ``"auto"`` is float16 (half the bytes each decode step
        reads at depth; the kernels widen it to float32 exactly), ``"q8_0"`` uint8 pools of Q8_0 rows; float32 where
        the C attention does not take the head dim or block size (`TorchOps`' attention runs instead), and for
        multi-head latent attention's `latent` pool (read by `TorchOps`' latent ops: float32 by default)."""
        if latent:
            return super().kv_cache_dtype(name, head_dim, block_size, latent)
        kernel = head_dim % 16 == 0 and head_dim <= cpu_native.MAX_HEAD_DIM and block_size % 16 == 0
        if name == "q8_0":
            if not (kernel and head_dim % 32 == 0):
                raise ValueError(f"kv_cache_dtype q8_0 needs a head dim that is a multiple of 32 (at most "
                                 f"{cpu_native.MAX_HEAD_DIM}) and a block size that is a multiple of 16; this model "
                                 f"has head dim {head_dim}, block size {block_size}")
            return torch.uint8
        if name == "auto":
            return torch.float16 if kernel else torch.float32
        return super().kv_cache_dtype(name, head_dim, block_size)

    def prepare_weight(self, weight: QTensor) -> torch.Tensor | CpuWeight:
        """The matrix in its CPU weight format (dense float32 for a shape the kernels do not take); a tied output
        head is the packed embedding table."""
        if not packable(weight):
            return super().prepare_weight(weight)
        return self._tables.get(_key(weight)) or CpuWeight.from_qtensor(weight)

    def prepare_joined(self, parts: list[QTensor]) -> list:
        """Quantized matrices of one type and row width packed as one, from where they lie (no joined copy)."""
        first = parts[0]
        if len(parts) > 1 and first.qtype in NATIVE_FORMATS and all(
            packable(p) and p.qtype == first.qtype and p.shape[1:] == first.shape[1:] for p in parts
        ):
            return [CpuWeight.from_parts(parts)]
        return super().prepare_joined(parts)

    def prepare_experts(
        self, gate_up: list[QTensor], down: QTensor, gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
    ) -> Experts:
        """The experts packed for `cpu_native.moe` (gate and up rows of each expert joined), weights quantized as
        stored; types the kernels do not take get `TorchOps`' dense experts."""
        if not (packable_experts(gate_up) and packable_experts([down]) and down.shape[2] % 32 == 0):
            return super().prepare_experts(gate_up, down, gate_up_bias, down_bias, activation, alpha, limit)
        e, hidden = down.shape[0], down.shape[1]
        rows = sum(p.shape[1] for p in gate_up)

        def bias(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(torch.float32).contiguous()

        return Experts(CpuExperts.from_qtensors(gate_up), CpuExperts.from_qtensors([down]), bias(gate_up_bias),
                       bias(down_bias), e, rows // 2, hidden, activation, alpha, limit)

    def moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
        """``[T, H]`` float32: each row's experts applied and summed in slot order, in the C kernel (only the
        active experts' weights are read; a row's result does not depend on the rest of the batch)."""
        if not isinstance(experts.gate_up, CpuExperts):
            return super().moe(x, ids, weights, experts)
        act = {"swiglu_oai": cpu_native.ACT_SWIGLU_OAI, "gelu_tanh": cpu_native.ACT_GELU_TANH}.get(
            experts.activation, cpu_native.ACT_SILU)
        out = x.new_empty(x.shape[0], experts.hidden_size)
        return cpu_native.moe(experts.gate_up.operand, experts.gate_up_bias, experts.down.operand, experts.down_bias,
                              x.contiguous(), experts.intermediate_size, ids.contiguous(),
                              weights.float().contiguous(), act, experts.alpha, experts.limit, out,
                              self.activation_bits)

    def short_conv(
        self, x: torch.Tensor, kernel: torch.Tensor, states: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """LFM2's short convolution over each sequence's rows and its state slot, in C (`TorchOps.short_conv`'s
        arithmetic, the same bits); torch's for a wider kernel than the C one takes."""
        if kernel.shape[0] > cpu_native.MAX_CONV_KERNEL or x.dtype != torch.float32 or x.stride(-1) != 1:
            return super().short_conv(x, kernel, states, meta)
        return cpu_native.short_conv(x, kernel, states, meta.state_slots, meta.positions, meta.query_start_loc,
                                     x.new_empty(x.shape))

    def gated_delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
        states: torch.Tensor, meta: BatchMetadata,
    ) -> torch.Tensor:
        """The gated delta rule over each sequence's rows and its state slot, in C, one row after another (the
        recurrent form for prefill too: a [Dk, 16] tile of a head's state stays in cache for the whole chunk);
        torch's for a key head wider than the C one takes."""
        views = (q, k, v)
        if q.shape[-1] > cpu_native.MAX_DELTA_KEY_DIM or any(
                t.dtype != torch.float32 or t.stride(-1) != 1 or t.stride(1) != t.shape[2] for t in views):
            return super().gated_delta_rule(q, k, v, decay, beta, states, meta)
        return cpu_native.gated_delta_rule(q, k, v, decay.float().contiguous(), beta.float().contiguous(), states,
                                           meta.state_slots, meta.positions, meta.query_start_loc,
                                           v.new_empty(v.shape, dtype=torch.float32))

    def ssm_scan(
        self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        states: torch.Tensor, meta: BatchMetadata,
    ) -> torch.Tensor:
        """Mamba2's selective scan over each sequence's rows and its state slot, in C, one row after another (the
        recurrent form for prefill too: an [N, 16] tile of a head's state stays in cache for the whole chunk);
        torch's for a state larger than the C one takes."""
        if b.shape[-1] > cpu_native.MAX_SSM_STATE or any(
                t.dtype != torch.float32 or t.stride(-1) != 1 or t.stride(1) != t.shape[2] for t in (x, b, c)):
            return super().ssm_scan(x, dt, a, b, c, states, meta)
        return cpu_native.ssm_scan(x, dt.float().contiguous(), a.float().contiguous(), b, c, states, meta.state_slots,
                                   meta.positions, meta.query_start_loc, x.new_empty(x.shape, dtype=torch.float32))

    def mamba2(
        self, zxbcdt: torch.Tensor, dims: tuple[int, int, int, int], kernel: torch.Tensor, conv_bias: torch.Tensor,
        dt_bias: torch.Tensor, a: torch.Tensor, d: torch.Tensor, norm: torch.Tensor, eps: float,
        conv_states: torch.Tensor, ssm_states: torch.Tensor, meta: BatchMetadata,
    ) -> torch.Tensor:
        """Mamba2's mixer in one C call (`TorchOps.mamba2`'s steps, the convolution and the scan as `short_conv`'s
        and `ssm_scan`'s C kernels compute them; the elementwise steps in C); torch's composition where those
        kernels do not take the shapes."""
        inner, heads, groups, n = dims
        if (kernel.shape[0] > cpu_native.MAX_CONV_KERNEL or n > cpu_native.MAX_SSM_STATE
                or zxbcdt.dtype != torch.float32 or zxbcdt.stride(-1) != 1):
            return super().mamba2(zxbcdt, dims, kernel, conv_bias, dt_bias, a, d, norm, eps, conv_states, ssm_states,
                                  meta)
        return cpu_native.mamba2(zxbcdt, inner, heads, groups, n, kernel, conv_bias, dt_bias, a, d, norm.contiguous(),
                                 eps, conv_states, ssm_states, meta.state_slots, meta.positions, meta.query_start_loc,
                                 zxbcdt.new_empty(zxbcdt.shape[0], inner))

    def layer_stack(self, decoder: Any, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                    states: list[torch.Tensor] = ()) -> Any:
        """The decoder's layers as one C call a step (`NativeStack`), or None where it does not take them."""
        return NativeStack.build(decoder, k_caches, v_caches, states)

    def prepare_embedding(self, weight: QTensor) -> QTensor | torch.Tensor | CpuWeight:
        """The table in its CPU weight format (rows are dequantized exactly)."""
        if not packable(weight):
            return super().prepare_embedding(weight)
        return self._tables.setdefault(_key(weight), CpuWeight.from_qtensor(weight))

    def prepare_step(self, meta: BatchMetadata, cos_sin: torch.Tensor, block_size: int) -> BatchMetadata:
        """The kernels read the metadata as it is."""
        return meta

    def prepare_rope(self, meta: BatchMetadata, cos_sin: torch.Tensor) -> BatchMetadata:
        """The kernels read a layer's rope table itself (`rope_and_cache`); the torch fallback derives its rows."""
        return meta

    def embedding(
        self, ids: torch.Tensor, table: QTensor | torch.Tensor | CpuWeight, scale: float = 1.0
    ) -> torch.Tensor:
        """Rows of the embedding table for `ids` times `scale` (Gemma, Granite), float32 ``[T, H]``."""
        if not isinstance(table, CpuWeight):
            return super().embedding(ids, table, scale)
        out = torch.empty(ids.shape[0], table.in_features)
        ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.long().contiguous()
        rows = cpu_native.embedding(table.fmt, table.blocks, table.out_features, ids, out)
        return rows.mul_(scale) if scale != 1.0 else rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor | CpuWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, float32."""
        if not isinstance(weight, CpuWeight):
            return super().linear(x, weight, bias)
        out = weight.matmul(x if x.is_contiguous() else x.contiguous(), self.activation_bits)
        return out if bias is None else out.add_(bias)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        x_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x * x_scale + residual) * weight, x * x_scale + residual)`` (`x_scale` only with a residual:
        Granite); the sum is written over `x` (a step's fresh activations)."""
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            return super().rms_norm(x, weight, eps, residual, x_scale)
        return cpu_native.rms_norm(x, residual, weight, eps, torch.empty_like(x), x_scale), x

    def post_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of a block's output ``[T, H]`` before it joins the residual stream (Gemma), float32."""
        x = x.contiguous()
        return cpu_native.rms_norm(x, None, weight, eps, torch.empty_like(x))

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of ``[T, heads, D]`` (Qwen3's and Gemma 3's q/k norm), float32."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # q or k out of the fused qkv output: row-strided
        return cpu_native.rms_norm(rows, None, weight, eps, torch.empty_like(rows)).view(x.shape)

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
        """Rotate q and k in place and write k, v to the pool (k blocks transposed, for `attention`)."""
        if not self._kernel_attention(q, k_cache):
            return super().rope_and_cache(q, k, v, cos_sin, k_cache, v_cache, meta)
        cpu_native.rope_and_cache(q, k, v, *rope_source(meta, cos_sin), meta.slot_mapping, k_cache, v_cache)
        return q, k

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
        """Causal attention of each sequence's new tokens over its context in the paged pool: ``[T, Hq, D]``
        (`window`: a sliding-window layer; `softcap`: Gemma 2's soft-capped scores; `sinks`: gpt-oss's sink
        logits)."""
        if not self._kernel_attention(q, k_cache):
            return super().attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
        if sinks is not None:
            return cpu_native.attention_sinks(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                              meta.block_tables, scale, q.new_empty(q.shape), window, softcap, sinks)
        return cpu_native.attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                    scale, q.new_empty(q.shape), window, softcap)

    @staticmethod
    def _kernel_attention(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether the C attention takes these shapes and this pool (else both it and the KV write are torch's, the
        pool keeping the standard layout; a Q8_0 pool is only ever made for shapes the kernels take)."""
        d = q.shape[-1]
        return (d % 16 == 0 and d <= cpu_native.MAX_HEAD_DIM and k_cache.shape[1] % 16 == 0
                and k_cache.dtype in cpu_native.KV_DTYPES)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """As `TorchOps.sample`; a batch that is all greedy takes its argmax in C (torch's is slow on the CPU)."""
        if logits.dtype == torch.float32 and logits.stride(-1) == 1 and not bool((temperature > 0).any()):
            return cpu_native.argmax(logits)
        return super().sample(logits, temperature, top_k, top_p, min_p, uniform)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``silu(gate) * up`` where `gate_up` is ``[T, 2 * I]`` (gate first)."""
        return cpu_native.silu_mul(gate_up, gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): ``gelu_tanh(gate) * up`` where `gate_up` is ``[T, 2 * I]`` (gate first)."""
        return cpu_native.gelu_tanh_mul(gate_up, gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))

    def soft_cap(self, x: torch.Tensor, cap: float, scale: float = 1.0) -> torch.Tensor:
        """Final logits: ``x * scale``, then ``cap * tanh(. / cap)`` when `cap` > 0; in place on the step's fresh
        logits (float32, unit column stride), else `TorchOps`' op."""
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            return super().soft_cap(x, cap, scale)
        return cpu_native.soft_cap(x, scale, cap)


def _key(weight: QTensor) -> tuple:
    """Which file tensor `weight` is, without keeping a reference to it (and so to the file's memory map)."""
    return weight.name, weight.data.data_ptr(), weight.shape, weight.qtype
