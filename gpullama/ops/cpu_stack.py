"""`NativeStack`: a decoder's layers as one call of `cpu_native.decoder` on the CPU fast path.

A decode step of a small model runs a few hundred kernels of a few microseconds each; called one at a time from
Python, the calls, views and allocations around them cost as much again as the kernels (docs/performance.md,
"One call a step"). The stack describes every layer once (its weights' blocks, norms, biases, rope table and KV
pool, as C structs) and each step passes only the step's metadata: the C loop calls the same kernels in the same
order as `Decoder.forward_pooled`'s loop, so a dense layer's results are the same bits. A MoE layer routes in C
(softmax and top k in float32, as `gpullama.ops.experts.route` computes them, though not in its summation order).

Granite 4.0-H's Mamba2 layers run here too (`gl_mamba2` between their two matrices, over the runner's state
pools at the step's `state_slots`), as does Granite's residual scale. `NativeStack.build` returns None for what the
loop handles and the stack does not: tensor parallelism, qwen2moe's sigmoid-gated shared expert (GLM-4.5's ungated
one runs here), grouped expert routing, multi-head latent attention (DeepSeek: its latent pool is read by torch),
the other recurrent layers (LFM2's short convolutions, Qwen3.5's gated delta-nets), Gemma 4's layers, a weight or
shape the kernels do not take.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from gpullama.kernels import cpu_native
from gpullama.ops.cpu_weights import CpuExperts, CpuWeight
from gpullama.ops.metadata import BatchMetadata

log = logging.getLogger("gpullama")

_GATINGS = {"softmax": 0, "softmax_topk": 1, "sigmoid": 2}
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


class Unsupported(Exception):
    """What the stack does not run (the layer loop does)."""


class NativeStack:
    """The layers of one decoder over one KV pool, ready for `cpu_native.decoder`."""

    def __init__(self, model: cpu_native.ModelParams, layers: ctypes.Array, keep: list[torch.Tensor]):
        self.model = model
        self.layers = layers
        self._keep = keep  # tensors the structs point into that the decoder does not hold itself

    @classmethod
    def build(cls, decoder: Any, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
              states: list[torch.Tensor] = ()) -> NativeStack | None:
        """The stack of `decoder` (a `gpullama.model.Decoder` on `CpuOps`) over its pools (`states`: the recurrent
        layers' state pools, as `Decoder.new_states` makes them), or None (and why, in the debug log) where the
        layer loop must run."""
        try:
            return cls._build(decoder, k_caches, v_caches, states)
        except Unsupported as e:
            log.debug("layers run one kernel call at a time: %s", e)
            return None

    @classmethod
    def _build(cls, decoder: Any, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
               states: list[torch.Tensor]) -> NativeStack:
        c = decoder.config
        if decoder.tp.world_size != 1:
            raise Unsupported("tensor parallelism")
        if c.is_mla:
            raise Unsupported("multi-head latent attention")
        if any(c.is_conv(i) or c.is_delta(i) for i in range(c.num_layers)):
            raise Unsupported(c.recurrent_layers_named)
        mamba = any(c.is_mamba(i) for i in range(c.num_layers))
        if mamba and (c.conv_kernel > cpu_native.MAX_CONV_KERNEL or c.ssm_state_size > cpu_native.MAX_SSM_STATE
                      or len(states) == 0):
            raise Unsupported("Mamba2 layers the C kernels do not take")
        if c.per_layer_input_size or c.kv_shared_layers or c.head_dim_swa or c.value_norm:
            raise Unsupported("Gemma 4's layers (two head sizes, shared K/V, per-layer inputs)")
        if c.activation not in _ACTIVATIONS:
            raise Unsupported(f"activation {c.activation}")
        hidden, d = decoder.layers[0].attn_norm.numel(), c.head_dim
        hq, hk = decoder.num_heads, decoder.num_kv_heads
        cache = k_caches[0]
        if not (d % 16 == 0 and d <= cpu_native.MAX_HEAD_DIM and cache.shape[1] % 16 == 0
                and cache.dtype in cpu_native.KV_DTYPES):
            raise Unsupported("a head dim or KV pool the C attention does not take")
        keep: list[torch.Tensor] = []

        def vec(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                t = t.to("cpu", torch.float32).contiguous()
                keep.append(t)
            return t.data_ptr()

        layers = (cpu_native.Layer * len(decoder.layers))()
        moe_layer = None
        for src, dst in zip(decoder.layers, layers, strict=True):
            dst.attn_norm, dst.ffn_norm = vec(src.attn_norm), vec(src.ffn_norm)
            dst.post_attn_norm, dst.post_ffn_norm = vec(src.post_attn_norm), vec(src.post_ffn_norm)
            if src.mamba is not None:  # its state pools: the convolution's, then the scan's (`Decoder._layers`)
                mw, inner = src.mamba, c.ssm_inner_size
                dst.mamba, dst.ssm_in, dst.ssm_out = 1, _mat(mw.in_proj, hidden), _mat(mw.out, inner, hidden)
                dst.conv_kernel, dst.conv_bias, dst.dt_bias = vec(mw.kernel), vec(mw.conv_bias), vec(mw.dt_bias)
                dst.ssm_a, dst.ssm_d, dst.ssm_norm = vec(mw.a), vec(mw.d), vec(mw.norm)
                dst.conv_states, dst.ssm_states = vec(states[src.cache]), vec(states[src.cache + 1])
            else:
                k_cache, v_cache = k_caches[src.cache], v_caches[src.cache]
                if k_cache.dtype != cache.dtype or v_cache.shape[1] != cache.shape[1]:
                    raise Unsupported("KV pools of different formats")
                dst.q_norm, dst.k_norm = vec(src.q_norm), vec(src.k_norm)
                _parts(dst.qkv, src.qkv, hidden, "q|k|v")
                dst.n_qkv, dst.qkv_bias = len(src.qkv), vec(src.qkv_bias)
                dst.o, dst.o_bias = _mat(src.o, hq * d, exact_rows=hidden), vec(src.o_bias)
                table = decoder.rope_tables[src.rope]
                dst.cos_sin, dst.rot_dim = vec(table), table.shape[1]
                dst.k_cache, dst.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
                dst.window, dst.sinks = src.window, vec(src.sinks)
            if src.moe is None:
                if not isinstance(src.down, CpuWeight):
                    raise Unsupported("a down matrix without a CPU format")
                inter = src.down.in_features
                if sum(_mat(w, hidden).n for w in src.gate_up) != 2 * inter:
                    raise Unsupported("gate|up rows not a multiple of 16")
                _parts(dst.gate_up, src.gate_up, hidden, "gate|up")
                dst.n_gate_up, dst.down, dst.inter = len(src.gate_up), _mat(src.down, inter, exact_rows=hidden), inter
            else:
                moe_layer = src.moe
                ex = moe_layer.experts
                if moe_layer.shared_gate is not None:
                    raise Unsupported("a sigmoid-gated shared expert")
                if moe_layer.shared_down is not None:
                    if not isinstance(moe_layer.shared_down, CpuWeight):
                        raise Unsupported("a shared expert without a CPU format")
                    inter = moe_layer.shared_down.in_features
                    if sum(_mat(w, hidden).n for w in moe_layer.shared_gate_up) != 2 * inter:
                        raise Unsupported("shared gate|up rows not a multiple of 16")
                    _parts(dst.shared_gate_up, moe_layer.shared_gate_up, hidden, "shared gate|up")
                    dst.n_shared_gate_up, dst.shared_inter = len(moe_layer.shared_gate_up), inter
                    dst.shared_down = _mat(moe_layer.shared_down, inter, exact_rows=hidden)
                if not isinstance(ex.gate_up, CpuExperts) or not isinstance(moe_layer.router, CpuWeight):
                    raise Unsupported("experts or a router without a CPU format")
                dst.router, dst.router_bias = _mat(moe_layer.router, hidden), vec(moe_layer.router_bias)
                dst.choice_bias = vec(moe_layer.choice_bias)
                (f1, w1), (f2, w2) = ex.gate_up.operand, ex.down.operand
                dst.fmt1, dst.w1, dst.stride1, dst.n1, dst.b1 = f1, w1.data_ptr(), w1[0].numel(), 16 * w1.shape[1], vec(
                    ex.gate_up_bias)
                dst.fmt2, dst.w2, dst.stride2, dst.n2, dst.b2 = f2, w2.data_ptr(), w2[0].numel(), 16 * w2.shape[1], vec(
                    ex.down_bias)
                dst.inter = ex.intermediate_size
        model = cpu_native.ModelParams(
            n_layers=len(layers), H=hidden, Hq=hq, Hk=hk, D=d, kvt=cpu_native.KV_DTYPES[cache.dtype],
            block_size=cache.shape[1], act=_ACTIVATIONS[c.activation], eps=c.rms_eps, scale=decoder.scale,
            softcap=c.attn_softcap, bits=decoder.ops.activation_bits, residual_scale=c.residual_scale,
        )
        if mamba:
            model.ssm_inner, model.ssm_heads, model.ssm_groups = c.ssm_inner_size, c.ssm_heads, c.ssm_groups
            model.ssm_n, model.conv_L = c.ssm_state_size, c.conv_kernel
        if moe_layer is not None:
            if c.expert_gating not in _GATINGS:
                raise Unsupported(f"expert gating {c.expert_gating}")
            if c.expert_groups > 1:
                raise Unsupported("grouped expert routing")
            ex = moe_layer.experts
            model.E, model.top_k, model.gating = ex.num_experts, c.num_experts_used, _GATINGS[c.expert_gating]
            model.norm_topk, model.expert_scale = int(c.expert_weights_norm), c.expert_weights_scale
            model.expert_act = cpu_native.ACT_SWIGLU_OAI if ex.activation == "swiglu_oai" else cpu_native.ACT_SILU
            model.alpha, model.limit = ex.alpha, ex.limit
        return cls(model, layers, keep)

    def __call__(self, hidden: torch.Tensor, meta: BatchMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream), both ``[T, H]`` float32, from the embeddings `hidden`
        (overwritten)."""
        residual = torch.empty_like(hidden)
        lora = None
        if meta.lora:  # each adapter's rows and scales (`meta.lora` keeps the tensors alive through the call)
            lora = (cpu_native.LoraGroup * len(meta.lora))()
            for dst, g in zip(lora, meta.lora):
                dst.layers, dst.R = ctypes.addressof(g.adapter.native()), g.rows.numel()
                dst.rows, dst.scales = g.rows.data_ptr(), g.scales.data_ptr()
        cpu_native.decoder(self.model, self.layers, hidden, residual, meta.positions, meta.slot_mapping,
                           meta.query_start_loc, meta.seq_lens, meta.block_tables, lora,
                           meta.state_slots if self.model.ssm_heads else None)
        return hidden, residual


def _mat(w: Any, k: int, exact_rows: int | None = None) -> cpu_native.Mat:
    """`w` as a `cpu_native.Mat`, when it is a `CpuWeight` of rows of `k` values (and, with `exact_rows`, exactly
    that many rows, unpadded)."""
    if not isinstance(w, CpuWeight) or w.in_features != k:
        raise Unsupported("a matrix without a CPU format")
    n = 16 * w.blocks.shape[0]
    if exact_rows is not None and n != exact_rows:
        raise Unsupported(f"a matrix of {w.out_features} rows where {exact_rows} are wanted, unpadded")
    return cpu_native.Mat(w.fmt, w.blocks.data_ptr(), n, k)


def _parts(dst: ctypes.Array, parts: list, k: int, what: str) -> None:
    """The parts of a fused matrix, side by side (each but a lone one with a multiple of 16 rows)."""
    if len(parts) > len(dst):
        raise Unsupported(f"{what} in {len(parts)} parts")
    for j, w in enumerate(parts):
        if not isinstance(w, CpuWeight):
            raise Unsupported(f"{what} without a CPU format")
        dst[j] = _mat(w, k, exact_rows=w.out_features if len(parts) > 1 else None)
