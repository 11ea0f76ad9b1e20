"""`TorchOps`: every op of the seam in plain torch: the CPU path, and the oracle the Triton kernels are tested against.

On the CPU in float32 it is the exact path: every matrix dequantized once to float32 (oneDNN's prepacked linear);
what the parity tests against transformers use. The CPU fast path (quantized weights, C kernels) is `CpuOps`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from gpullama.ops.experts import Experts, activate, expert_rows, route
from gpullama.ops.metadata import BatchMetadata, rope_source
from gpullama.ops.sampling import keep_mask
from gpullama.quants import QTensor, concat_rows


class TorchOps:
    """Reference implementation of every op in plain torch."""

    name = "torch"  # for logs and benchmark labels; code asks the capabilities below, never the name
    supports_cuda_graphs = False  # whether a decode step of these ops can be captured and replayed as a CUDA graph

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32):
        self.device = device
        # dtype of the matmul weights and inputs; norms, attention and the residual stream stay float32
        self.dtype = dtype
        # On the CPU, oneDNN's prepacked linear: about 2-4x MKL's sgemm here.
        # (bfloat16 only where oneDNN has bf16 kernels for this CPU: AVX-512 BW/VL/DQ or AVX-NE-CONVERT)
        self.packed = device.type == "cpu" and _has_packed_linear() and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and _mkldnn_bf16()))

    @property
    def mode(self) -> str:
        """What the matmuls run on, for logs and benchmark labels."""
        return f"dense {str(self.dtype).removeprefix('torch.')}"

    def kv_cache_dtype(self, name: str, head_dim: int, block_size: int, latent: bool = False) -> torch.dtype:
        """The KV pool's dtype for the engine argument `kv_cache_dtype` (`name`): ``"auto"`` is float32 on the CPU
        (this path's attention computes in float32) and the compute dtype on a GPU; the CPU also takes float16 and
        bfloat16 (read back as float32); ``"q8_0"`` needs the CPU fast path, and not a `latent` pool (multi-head
        latent attention's, which every backend reads with the torch layout). Raises ValueError otherwise."""
        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if latent and name not in ("auto", *dtypes):
            raise ValueError(f"kv_cache_dtype {name!r} is not available for multi-head latent attention's pool: use "
                             f"auto, float32, float16 or bfloat16")
        if name == "auto":
            return torch.float32 if self.device.type == "cpu" else self.dtype
        if self.device.type != "cpu" and dtypes.get(name) != self.dtype:
            raise ValueError(f"kv_cache_dtype {name!r} is not available on {self.device.type}: use auto (the "
                             f"compute dtype, {str(self.dtype).removeprefix('torch.')})")
        if name not in dtypes:
            raise ValueError(f"kv_cache_dtype {name!r} needs the CPU fast path (dtype auto on a quantized file, "
                             f"with a C compiler); this model runs {self.mode}")
        return dtypes[name]

    # -- weights -------------------------------------------------------------------------------
    def prepare_weight(self, weight: QTensor) -> torch.Tensor:
        """Turn a GGUF tensor into what `linear` consumes: a dense matrix in the compute dtype (prepacked by oneDNN
        on the CPU)."""
        dense = weight.dequantize(torch.float32).to(device=self.device, dtype=self.dtype).contiguous()
        return torch.ops.mkldnn._reorder_linear_weight(dense) if self.packed else dense

    def prepare_joined(self, parts: list[QTensor]) -> list:
        """Matrices that read one input (q|k|v, gate|up) for `linear`: one weight of their rows stacked where they
        share a type and row width, else one weight each."""
        joined = concat_rows(parts)
        return [self.prepare_weight(joined)] if joined is not None else [self.prepare_weight(p) for p in parts]

    def prepare_experts(
        self, gate_up: list[QTensor], down: QTensor, gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
    ) -> Experts:
        """A MoE layer's experts from their stacked GGUF tensors: `gate_up` is ``[ffn_gate_up_exps]`` ``[E, 2I, H]``
        or ``[ffn_gate_exps, ffn_up_exps]``, each ``[E, I, H]``; `down` is ``[E, H, I]``; biases float32 ``[E, 2I]``
        and ``[E, H]``. Here dense matrices in the compute dtype."""
        dense = [p.dequantize(torch.float32) for p in gate_up]
        w1 = dense[0] if len(dense) == 1 else torch.cat(dense, dim=1)
        e, rows, hidden = w1.shape
        return Experts(
            w1.to(device=self.device, dtype=self.dtype).contiguous(),
            down.dequantize(torch.float32).to(device=self.device, dtype=self.dtype).contiguous(),
            _on(gate_up_bias, self.device), _on(down_bias, self.device), e, rows // 2, hidden, activation, alpha, limit,
        )

    def prepare_head_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """One matrix per head, ``[heads, N, K]`` float32 (MLA's attn_k_b and attn_v_b), as `heads_matmul` reads
        them: in the compute dtype on the device."""
        return weights.to(device=self.device, dtype=self.dtype).contiguous()

    def prepare_embedding(self, weight: QTensor) -> QTensor | torch.Tensor:
        """Embedding table as `embedding` consumes it (kept in GGUF blocks: rows are gathered, then dequantized);
        on the CPU a copy, so that nothing keeps the file's memory map (and its pages) once the load is done."""
        if self.device.type == "cpu":
            return QTensor(weight.data.clone(), weight.qtype, weight.shape, weight.name)
        return weight.to(self.device)

    def prepare_step(self, meta: BatchMetadata, cos_sin: torch.Tensor, block_size: int) -> BatchMetadata:
        """`meta` with the per-step tensors these ops read, derived once per step instead of once per layer: the
        rotary rows of the batch's positions, and for a decode batch the pool rows and mask of every context."""
        derived = dict(zip(("rope_cos", "rope_sin"), rope_rows(*rope_source(meta, cos_sin))))
        if meta.is_decode:
            derived["context_slots"], derived["context_mask"] = decode_context(meta, block_size)
        return dataclasses.replace(meta, **derived)

    def prepare_rope(self, meta: BatchMetadata, cos_sin: torch.Tensor) -> BatchMetadata:
        """`meta` with the rotary rows of another rope table (Gemma 3's sliding layers), once per step."""
        return dataclasses.replace(meta, **dict(zip(("rope_cos", "rope_sin"), rope_rows(cos_sin, meta.positions))))

    def layer_stack(self, decoder: Any, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                    states: list[torch.Tensor] = ()) -> Any:
        """A callable that runs all of `decoder`'s layers over a step's embeddings in one go, ``(hidden, meta) ->
        (last layer's output, residual stream)``, over these KV and recurrent-state pools, or None: the decoder's
        layer loop runs the ops one at a time."""
        return None

    # -- ops -------------------------------------------------------------------------------------
    def embedding(self, ids: torch.Tensor, table: QTensor | torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Rows of the embedding table for `ids` times `scale` (Gemma, Granite), float32 ``[T, H]``."""
        if isinstance(table, QTensor):
            rows = table.take_rows(ids).dequantize(torch.float32)
        else:
            rows = table[ids].float()
        return rows * scale if scale != 1.0 else rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` in float32."""
        x = x.to(self.dtype)
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "").float()
        else:
            out = F.linear(x, weight).float()
        if bias is not None:
            out = out + bias
        return out

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        x_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm fused with the residual add: returns ``(norm(x * x_scale + residual) * weight, x * x_scale +
        residual)`` (`x_scale`: Granite's residual multiplier, used only with a residual); the sum keeps the
        residual's dtype (float32 on the CPU)."""
        if residual is not None:
            x = (x.float() * x_scale if x_scale != 1.0 else x) + residual
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight, x  # F.rms_norm is slower on the CPU

    def post_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of a block's output ``[T, H]`` before it joins the residual stream (Gemma), float32."""
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of ``[T, heads, D]`` (Qwen3's q/k norm), in the weight's dtype."""
        x = x.to(weight.dtype)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        """LayerNorm with weight and bias over the last dim of ``[T, H]`` (the vision towers' norm), in the weight's
        dtype (float32)."""
        return F.layer_norm(x.to(weight.dtype), (x.shape[-1],), weight, bias, eps)

    def gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """GELU of ``[T, N]`` (float32, as `linear` gives it): ``none`` (erf), ``tanh``, or ``quick`` (QuickGELU,
        ``x * sigmoid(1.702 x)``: Qwen2-VL's tower)."""
        if approximate == "quick":
            return x * torch.sigmoid(1.702 * x)
        return F.gelu(x, approximate=approximate)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` by row t of ``cos_sin [T, R]`` each (cos|sin of each half,
        NeoX halves, as `rope_and_cache`; the Qwen-VL towers' 2D rotary), nothing written to a pool; float32."""
        cos, sin = rope_rows(cos_sin, torch.arange(cos_sin.shape[0], device=cos_sin.device))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def image_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
        """A vision tower's attention: every patch of ``[B, heads, n, D]`` q, k, v attends to every other one (or
        to those `mask` ``[n, n]`` allows: Qwen2.5-VL's windows), no KV pool, in the inputs' dtype (float32, as
        `linear` gives them): ``[B, heads, n, D]``."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

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
        """Rotate q and k (NeoX halves; `cos_sin` is ``[max_pos, R]`` = cos|sin of each half, rotating the first
        R <= D dims of each head: partial rotary) and write k, v to the pool."""
        cos, sin = (meta.rope_cos, meta.rope_sin) if meta.rope_cos is not None else \
            rope_rows(*rope_source(meta, cos_sin))
        q = _rotate(q, cos, sin)
        k = _rotate(k, cos, sin)
        num_blocks, block_size = k_cache.shape[:2]
        k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        return q, k

    def rope(self, q: torch.Tensor, cos_sin: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """Rotate q alone, as `rope_and_cache` does, for a layer that attends over another layer's K/V (Gemma 4's
        shared layers); float32."""
        cos, sin = (meta.rope_cos, meta.rope_sin) if meta.rope_cos is not None else \
            rope_rows(*rope_source(meta, cos_sin))
        return _rotate(q, cos, sin)

    def short_conv(
        self, x: torch.Tensor, kernel: torch.Tensor, states: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """LFM2's causal depthwise convolution of each sequence's new rows ``x [T, H]``: row t of channel c is
        ``sum_j kernel[j, c] * input[t - L + 1 + j, c]`` (``kernel [L, H]``, the taps added in order j = 0 .. L-1),
        the inputs before the step's first row read from the sequence's slot of ``states [slots, L - 1, H]``
        (zeros for a sequence starting at position 0), which then holds its last L - 1 inputs; float32 ``[T, H]``."""
        lk, slots = kernel.shape[0], meta.state_slots
        if meta.is_decode:  # one row a sequence: gather the states, convolve, write them back (no host values)
            past = states.index_select(0, slots)
            past = torch.where((meta.positions == 0)[:, None, None], 0.0, past)
            window = torch.cat((past, x[:, None, :].float()), dim=1)  # [B, L, H]
            states.index_copy_(0, slots, window[:, 1:])
            return _taps(window, kernel, 1)
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            a, b = starts[i], starts[i + 1]
            if a == b:
                continue
            slot = slots[i]
            past = states[slot] if seq_len > b - a else states.new_zeros(lk - 1, x.shape[1])
            full = torch.cat((past, x[a:b].float()))  # [L - 1 + n, H]
            out[a:b] = _taps(full.unfold(0, lk, 1).transpose(1, 2), kernel, 1)
            states[slot] = full[-(lk - 1) :]
        return out

    def gated_delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
        states: torch.Tensor, meta: BatchMetadata,
    ) -> torch.Tensor:
        """The gated delta rule (Qwen3.5's linear attention) over each sequence's new rows: ``q``, ``k [T, Hk, Dk]``,
        ``v [T, Hv, Dv]``, ``decay``, ``beta [T, Hv]`` (value head h reads key head h mod Hk); q and k are
        L2-normalized (eps 1e-6 inside the root, as the FLA kernels) and q scaled by Dk^-0.5. Each value head's
        state ``S [Dk, Dv]`` (the sequence's slot of ``states [slots, Hv, Dk, Dv]``, zeros for a sequence starting
        at position 0) takes each row in turn: ``S *= exp(decay)``, ``S += k (beta (v - k S))^T``, ``out = q S``.
        A decode batch steps every sequence once (that recurrence); a longer chunk runs the chunked form
        (`chunked_delta_rule`, 64 rows a chunk: the same sums regrouped into matrix products). Float32 ``[T, Hv,
        Dv]``; the slots hold the states after the rows."""
        q, k, v = _expand_heads(_l2norm(q) * q.shape[-1] ** -0.5, v.shape[1]), _expand_heads(_l2norm(k), v.shape[1]), \
            v.float()
        return _scan_sequences((q, k, v, decay.float(), beta.float()), states, meta, recurrent_delta_rule,
                               chunked_delta_rule, out_like=v)

    def ssm_scan(
        self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        states: torch.Tensor, meta: BatchMetadata,
    ) -> torch.Tensor:
        """Mamba2's selective scan over each sequence's new rows: ``x [T, H, P]``, ``dt [T, H]`` (after softplus),
        ``a [H]`` (negative), ``b``, ``c [T, G, N]`` (head h reads group h // (H / G), transformers' and ggml's
        repeat_interleave order). Each head's state ``S [N, P]`` (the sequence's slot of ``states [slots, H, N,
        P]``, zeros for a sequence starting at position 0) takes each row in turn: ``S = exp(dt a) S + b (dt
        x)^T``, ``y = c S``. A decode batch steps every sequence once (that recurrence); a longer chunk runs the
        chunked form (`chunked_ssm_scan`, 64 rows a chunk: the same sums regrouped into matrix products). Float32
        ``[T, H, P]`` (without the D skip); the slots hold the states after the rows."""
        heads = x.shape[1]
        x, dt, a = x.float(), dt.float(), a.float()
        b = b.float().repeat_interleave(heads // b.shape[1], dim=1)
        c = c.float().repeat_interleave(heads // c.shape[1], dim=1)
        return _scan_sequences((x, dt, b, c), states, meta,
                               lambda x, dt, b, c, state: recurrent_ssm_scan(x, dt, a, b, c, state),
                               lambda x, dt, b, c, state: chunked_ssm_scan(x, dt, a, b, c, state), out_like=x)

    def mamba2(
        self, zxbcdt: torch.Tensor, dims: tuple[int, int, int, int], kernel: torch.Tensor, conv_bias: torch.Tensor,
        dt_bias: torch.Tensor, a: torch.Tensor, d: torch.Tensor, norm: torch.Tensor, eps: float,
        conv_states: torch.Tensor, ssm_states: torch.Tensor, meta: BatchMetadata,
    ) -> torch.Tensor:
        """Mamba2's mixer between its two matrices: each row of ``zxbcdt`` (in_proj's output) is z [inner] | x B C
        [inner + 2 G N] | dt [heads] (``dims = (inner, heads, G, N)``). x B C through the causal convolution
        (`short_conv`, ``conv_states``) plus ``conv_bias`` and SiLU; the selective scan (`ssm_scan`, ``ssm_states``)
        of x, B, C with ``softplus(dt + dt_bias)``; ``y + d x`` (d a head), times ``silu(z)``, each group of inner / G
        values through an RMSNorm times ``norm [G, inner / G]``. Float32 ``[T, inner]``: out_proj's input."""
        inner, heads, groups, n = dims
        t, channels = zxbcdt.shape[0], inner + 2 * groups * n
        xbc = F.silu(self.short_conv(zxbcdt[:, inner : inner + channels], kernel, conv_states, meta) + conv_bias)
        xs = xbc[:, :inner].view(t, heads, inner // heads)
        dt = F.softplus(zxbcdt[:, inner + channels :] + dt_bias)
        y = self.ssm_scan(xs, dt, a, xbc[:, inner : inner + groups * n].view(t, groups, n),
                          xbc[:, inner + groups * n :].view(t, groups, n), ssm_states, meta)
        y = (y + xs * d[:, None]) * F.silu(zxbcdt[:, :inner].view(t, heads, inner // heads))
        y = y.reshape(t, groups, inner // groups)  # RMSNorm per group
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * norm
        return y.reshape(t, inner)

    def heads_matmul(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each head's own matrix: ``x [T, heads, K]`` times ``weights [heads, N, K]`` (transposed) is ``[T, heads,
        N]``, float32."""
        return torch.einsum("thk,hnk->thn", x.to(weights.dtype), weights).float()

    def latent_rope_and_cache(
        self, q: torch.Tensor, rows: torch.Tensor, cos_sin: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """Multi-head latent attention's `rope_and_cache`: rotate the first R dims (`cos_sin` ``[max_pos, R]``) of
        the queries ``q [T, Hq, D]`` and of each token's cache row ``rows [T, 1, D]`` (rotary | latent), and write
        the rows into the pool ``cache [num_blocks, block_size, 1, D]`` at `meta.slot_mapping`; returns q. There
        is no value pool: the values are the latent part of the same rows (`latent_attention`)."""
        cos, sin = (meta.rope_cos, meta.rope_sin) if meta.rope_cos is not None else \
            rope_rows(*rope_source(meta, cos_sin))
        q, rows = _rotate(q, cos, sin), _rotate(rows, cos, sin)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, meta.slot_mapping, rows.to(cache.dtype))
        return q

    def latent_attention(
        self, q: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float, value_start: int
    ) -> torch.Tensor:
        """Causal attention of each sequence's new queries ``q [T, Hq, D]`` over its rows in the latent pool
        ``cache [num_blocks, block_size, 1, D]`` (every head reads the same rows), the values being each row's dims
        from `value_start` on (the latent): float32 ``[T, Hq, D - value_start]``."""
        d = cache.shape[-1]
        if meta.is_decode:
            slots, valid = meta.context_slots, meta.context_mask
            if slots is None:
                slots, valid = decode_context(meta, cache.shape[1])
            rows = cache.view(-1, d).index_select(0, slots.view(-1)).view(slots.shape[0], 1, -1, d).float()
            o = F.scaled_dot_product_attention(q[:, :, None, :], rows, rows[..., value_start:], attn_mask=valid,
                                               scale=scale, enable_gqa=True)
            return o[:, :, 0, :]
        out = q.new_empty(q.shape[0], q.shape[1], d - value_start)
        block_size = cache.shape[1]
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            q_start, q_end = starts[i], starts[i + 1]
            if q_end == q_start:
                continue
            blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
            rows = cache[blocks].flatten(0, 1)[:seq_len].float().transpose(0, 1)  # [1, S, D]
            positions = torch.arange(q_end - q_start, device=q.device)[:, None] + (seq_len - (q_end - q_start))
            mask = torch.arange(seq_len, device=q.device)[None, :] <= positions
            o = F.scaled_dot_product_attention(q[q_start:q_end].transpose(0, 1), rows, rows[..., value_start:],
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[q_start:q_end] = o.transpose(0, 1)
        return out

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
        """Causal attention of each sequence's new tokens over its context in the paged pool: ``[T, Hq, D]``.

        `window` > 0: a query at position p sees only positions above ``p - window`` (a sliding-window layer);
        `softcap` > 0: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2); `sinks`
        ``[Hq]`` float32: each head's softmax also counts ``exp(sink)`` (a key of its own, with no value: gpt-oss)."""
        if meta.is_decode:
            return self._decode_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        hq, hk = q.shape[1], k_cache.shape[2]
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            if q_len == 0:
                continue
            n_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[i, :n_blocks].long()
            keys = k_cache[blocks].flatten(0, 1)[:seq_len].float()
            values = v_cache[blocks].flatten(0, 1)[:seq_len].float()
            if window or softcap or sinks is not None:  # keys from the first one the first query sees (SDPA has no
                # soft-capping and no sinks)
                first = max(0, seq_len - q_len - window + 1) if window else 0
                rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
                cols = torch.arange(first, seq_len, device=q.device)[None, :]
                visible = (cols <= rows) & (cols > rows - window) if window else cols <= rows
                keys, values = keys[first:], values[first:]
                if softcap or sinks is not None:
                    out[q_start:q_end] = rowwise_attention(q[None, q_start:q_end], keys[None], values[None],
                                                           visible[None], scale, softcap, sinks)[0]
                else:
                    o = F.scaled_dot_product_attention(q[q_start:q_end].transpose(0, 1), keys.transpose(0, 1),
                                                       values.transpose(0, 1), attn_mask=visible, scale=scale,
                                                       enable_gqa=hq != hk)
                    out[q_start:q_end] = o.transpose(0, 1)
                continue
            qi = q[q_start:q_end].transpose(0, 1)  # [Hq, L, D]
            ki = keys.transpose(0, 1)  # [Hk, S, D]
            vi = values.transpose(0, 1)
            mask = None
            if q_len > 1:
                # bottom-right aligned causal mask: query j sits at position seq_len - q_len + j
                rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=hq != hk)
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    def _decode_attention(
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
        """One new token per sequence: gather every context into one padded batch and attend in a single call."""
        slots, valid = meta.context_slots, meta.context_mask
        if slots is None:
            slots, valid = decode_context(meta, k_cache.shape[1])
        batch, width = slots.shape
        hk, d = k_cache.shape[2:]
        if window:  # the new token at seq_len - 1 sees positions from seq_len - window on
            position = torch.arange(width, device=slots.device)
            valid = valid & (position[None, :] >= meta.seq_lens[:, None] - window)[:, None, None, :]
        flat = slots.view(-1)
        keys = k_cache.view(-1, hk, d).index_select(0, flat).view(batch, width, hk, d)
        values = v_cache.view(-1, hk, d).index_select(0, flat).view(batch, width, hk, d)
        if softcap or sinks is not None:
            return rowwise_attention(q[:, None], keys, values, valid.view(batch, 1, width), scale, softcap,
                                     sinks)[:, 0]
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], keys.transpose(1, 2).float(), values.transpose(1, 2).float(), attn_mask=valid,
            scale=scale, enable_gqa=q.shape[1] != hk,
        )
        return o[:, :, 0, :]

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """Next token of each row ``[B]`` int64: argmax where temperature <= 0, else the first token whose running
        sum of kept probability (vocab order) exceeds ``uniform`` of the kept total (one U[0, 1) per row)."""
        logits = logits.float()
        hot = (temperature > 0).nonzero()[:, 0]
        if hot.numel() == 0:
            return logits.argmax(dim=-1)
        all_hot = hot.numel() == logits.shape[0]
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device) if all_hot else logits.argmax(-1)
        x = logits if all_hot else logits[hot]
        e = torch.exp((x - x.max(dim=-1, keepdim=True).values) / temperature[hot, None].float())
        keep = keep_mask(e, top_k[hot], top_p[hot], min_p[hot])
        cdf = torch.where(keep, e, 0.0).cumsum(-1)
        target = uniform[hot].float() * cdf[:, -1]
        # the cdf never decreases, and it rises only at kept tokens: the first index where it passes the target is
        # the first kept token that does
        first = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
        past = first >= e.shape[-1]
        if bool(past.any()):  # rounding left the target at the total: the last kept token
            index = torch.arange(e.shape[-1], device=e.device)
            first = torch.where(past, torch.where(keep, index, -1).max(-1).values, first)
        tokens[hot] = first
        return tokens

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``silu(gate) * up`` where `gate_up` is ``[T, 2 * I]`` (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def route(
        self, logits: torch.Tensor, k: int, gating: str = "softmax", norm: bool = False, scale: float = 1.0,
        bias: torch.Tensor | None = None, groups: int = 1, groups_used: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's `k` experts ``[T, k]`` int64 and weights ``[T, k]`` float32 from router logits ``[T, E]``
        (see `gpullama.ops.experts.route`: the gating, the choice's bias and groups)."""
        return route(logits, k, gating, norm, scale, bias, groups, groups_used)

    def moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
        """``[T, H]`` float32: each row's experts ``ids [T, k]`` applied to it, weighted by ``weights [T, k]`` and
        summed. Each active expert runs once over all its rows, in expert order (transformers' eager loop)."""
        out = torch.zeros(x.shape[0], experts.hidden_size, dtype=torch.float32, device=x.device)
        for e, tokens, slots in expert_rows(ids, experts.num_experts):
            bias1 = experts.gate_up_bias[e] if experts.gate_up_bias is not None else None
            bias2 = experts.down_bias[e] if experts.down_bias is not None else None
            h = activate(_plain_linear(x[tokens], experts.gate_up[e], bias1), experts.activation, experts.alpha,
                         experts.limit)
            y = _plain_linear(h, experts.down[e], bias2)
            out.index_add_(0, tokens, y * weights[tokens, slots, None])
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): ``gelu_tanh(gate) * up`` where `gate_up` is ``[T, 2 * I]`` (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def soft_cap(self, x: torch.Tensor, cap: float, scale: float = 1.0) -> torch.Tensor:
        """Final logits: ``x * scale`` (Granite's 1 / logit_scale), then ``cap * tanh(. / cap)`` when `cap` > 0
        (Gemma 2's soft-capping); float32."""
        x = x.float() * scale if scale != 1.0 else x.float()
        return torch.tanh(x / cap) * cap if cap else x


def _scan_sequences(
    rows: tuple[torch.Tensor, ...], states: torch.Tensor, meta: BatchMetadata, recurrent, chunked,
    out_like: torch.Tensor,
) -> torch.Tensor:
    """A recurrent layer over each sequence's new rows: `rows` (tensors ``[T, ...]``) cut at the batch's sequence
    bounds, each sequence's state read from its slot of `states` (zeros for a sequence starting at position 0) and
    written back after its rows. ``recurrent(*rows, state [B, ...])`` steps one row a sequence (a decode batch in
    one call: no host values), ``chunked(*rows, state)`` runs a longer chunk; both return ``(out, new state)``.
    Float32 in `out_like`'s shape."""
    slots = meta.state_slots
    if meta.is_decode:
        first = (meta.positions == 0).view(-1, *[1] * (states.dim() - 1))
        out, state = recurrent(*rows, torch.where(first, 0.0, states.index_select(0, slots)))
        states.index_copy_(0, slots, state)
        return out
    out = torch.empty(out_like.shape, dtype=torch.float32, device=out_like.device)
    starts = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        lo, hi = starts[i], starts[i + 1]
        if lo == hi:
            continue
        slot = slots[i]
        state = states[slot] if seq_len > hi - lo else torch.zeros_like(states[slot])
        cut = [r[lo:hi] for r in rows]
        if hi - lo == 1:
            o, new_state = recurrent(*cut, state[None])
            out[lo:hi], states[slot] = o, new_state[0]
        else:
            out[lo:hi], states[slot] = chunked(*cut, state)
    return out


def _taps(window: torch.Tensor, kernel: torch.Tensor, dim: int) -> torch.Tensor:
    """``sum_j kernel[j] * window[..., j, ...]`` along `dim` (of size L), added in order j = 0 .. L-1."""
    out = window.select(dim, 0) * kernel[0]
    for j in range(1, kernel.shape[0]):
        out = out + window.select(dim, j) * kernel[j]
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """Each row of the last dim over its L2 norm, float32 (``rsqrt(sum x^2 + 1e-6)``, as transformers and FLA)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, Hk, D]`` -> ``[T, heads, D]``, head h being head h mod Hk (llama.cpp's converter orders the value heads
    so; ggml's broadcast)."""
    return x if x.shape[1] == heads else x.repeat(1, heads // x.shape[1], 1)


def recurrent_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one row at a time: rows ``q``, ``k [N, H, Dk]`` (normalized, q scaled), ``v [N, H, Dv]``,
    ``decay``, ``beta [N, H]`` and ``state [N, H, Dk, Dv]``, one step each (a decode batch: N sequences), or one
    sequence's rows in turn when `state` is ``[1, H, Dk, Dv]``. Returns (out ``[N, H, Dv]``, the new state)."""
    if state.shape[0] != q.shape[0]:  # one sequence's rows in order
        outs = []
        for t in range(q.shape[0]):
            o, state = recurrent_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1],
                                            beta[t : t + 1], state)
            outs.append(o)
        return torch.cat(outs), state
    state = state * decay.exp()[..., None, None]
    kv = (state * k[..., None]).sum(-2)  # [N, H, Dv]: what the state recalls for k
    state = state + k[..., None] * ((v - kv) * beta[..., None])[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's rows ``q``, ``k [N, H, Dk]``, ``v [N, H, Dv]``, ``decay``, ``beta
    [N, H]`` from ``state [H, Dk, Dv]``, `chunk` rows at a time: within a chunk the updates are condensed by the UT
    transform (a unit lower-triangular solve) into matrix products, then the state carries to the next chunk
    (transformers' `torch_chunk_gated_delta_rule`, the same arithmetic). Returns (out ``[N, H, Dv]``, new state)."""
    n = q.shape[0]
    pad = (-n) % chunk  # zero rows at the end: no update (k = 0, beta = 0) and no decay (0 in log space)
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, N', D]
    decay, beta = (F.pad(x.t(), (0, pad)) for x in (decay, beta))  # [H, N']
    h = q.shape[0]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(h, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = decay.reshape(h, -1, chunk).cumsum(-1)  # log of the decay from the chunk's start to each row
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # decay from row j to row i
    system = (k_beta @ k.transpose(-1, -2)) * pair
    inner = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    state = state.float()
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + inner[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, out.shape[-1])[:, :n].transpose(0, 1), state


def recurrent_ssm_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan one row at a time: rows ``x [M, H, P]``, ``dt [M, H]``, ``b``, ``c [M, H, N]`` (one group a
    head already) and ``state [M, H, N, P]``, one step each (a decode batch: M sequences), or one sequence's rows in
    turn when `state` is ``[1, H, N, P]``. Returns (out ``[M, H, P]``, the new state)."""
    if state.shape[0] != x.shape[0]:  # one sequence's rows in order
        outs = []
        for t in range(x.shape[0]):
            o, state = recurrent_ssm_scan(x[t : t + 1], dt[t : t + 1], a, b[t : t + 1], c[t : t + 1], state)
            outs.append(o)
        return torch.cat(outs), state
    state = state * (dt * a).exp()[..., None, None] + b[..., None] * (dt[..., None] * x)[..., None, :]
    return (state * c[..., None]).sum(-2), state


def chunked_ssm_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan over one sequence's rows ``x [M, H, P]``, ``dt [M, H]``, ``b``, ``c [M, H, N]`` from ``state
    [H, N, P]``, `chunk` rows at a time (state-space duality): within a chunk row i's output is ``sum_j<=i (c_i .
    b_j) exp(A_i - A_j) dt_j x_j`` (A the running sum of dt a) plus ``exp(A_i) c_i S``, then the state carries to
    the next chunk. Returns (out ``[M, H, P]``, new state)."""
    m = x.shape[0]
    pad = (-m) % chunk  # zero rows at the end: dt = 0 neither decays nor adds
    x, b, c = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (x, b, c))  # [H, M', .]
    dt = F.pad(dt.t(), (0, pad))  # [H, M']
    h = x.shape[0]
    x, b, c = (t.reshape(h, -1, chunk, t.shape[-1]) for t in (x, b, c))
    dt = dt.reshape(h, -1, chunk)
    g = (dt * a[:, None, None]).cumsum(-1)  # log of the decay from the chunk's start to each row
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).triu(1)
    pair = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # decay from row j to row i
    inputs = x * dt[..., None]  # [H, chunks, L, P]
    intra = ((c @ b.transpose(-1, -2)) * pair) @ inputs
    read = c * g.exp()[..., None]  # each row reads the chunk's starting state decayed to it
    carry = inputs * (g[..., -1:] - g).exp()[..., None]  # each row's input decayed to the chunk's end
    out = torch.empty_like(intra)
    state = state.float()
    for i in range(x.shape[1]):
        out[:, i] = intra[:, i] + read[:, i] @ state
        state = state * g[:, i, -1].exp()[:, None, None] + b[:, i].transpose(-1, -2) @ carry[:, i]
    return out.reshape(h, -1, out.shape[-1])[:, :m].transpose(0, 1), state


def _plain_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in w's dtype, float32 out (weights not prepacked)."""
    out = F.linear(x.to(w.dtype), w).float()
    return out if bias is None else out + bias


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device=device, dtype=torch.float32).contiguous()


def _has_packed_linear() -> bool:
    """Whether this torch build has oneDNN's prepacked linear ops."""
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(
        mkldnn, "_linear_pointwise"
    )


def _mkldnn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 matmuls on this CPU."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotary embedding: the first half of the rotated dims pairs with the second half (`cos` is the
    angles' cosines for both halves, `sin` their sines with the first half negated); a head wider than the
    ``R`` dims of `cos` keeps its last ``D - R`` dims as they are (partial rotary); float32 out."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((_rotate(x[..., :r], cos, sin), x[..., r:].float()), dim=-1)
    return x * cos + x.roll(r // 2, dims=-1) * sin


def rowwise_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention whose every row comes out the same however the batch around it is cut: ``q [B, L, Hq, D]`` over
    ``keys``/``values [B, S, Hk, D]`` where ``visible [B, L, S]``; float32 ``[B, L, Hq, D]``. `softcap` > 0 caps
    the scores at ``softcap * tanh(scores / softcap)`` (Gemma 2); `sinks` ``[Hq]`` joins each head's softmax as
    one more score whose value is zero (gpt-oss).

    Computed in float64 (SDPA has no soft-capping), where the rounding differences of batch shapes sit far below
    float32's.
    """
    b, n, hq, d = q.shape
    hk = keys.shape[2]
    g = hq // hk
    qh = (q.to(torch.float64) * scale).view(b, n, hk, g, d).permute(0, 2, 1, 3, 4).reshape(b, hk, n * g, d)
    scores = torch.matmul(qh, keys.to(torch.float64).permute(0, 2, 3, 1))  # [B, Hk, L * G, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visible[:, None, :, None, :].expand(b, 1, n, g, visible.shape[-1]).reshape(b, 1, n * g, -1)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # head hk * G + j's sink beside each of its rows (row i * G + j of [B, Hk, L * G, S])
        sink = sinks.to(torch.float64).view(1, hk, 1, g).expand(b, hk, n, g).reshape(b, hk, n * g, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    out = torch.matmul(probs, values.to(torch.float64).transpose(1, 2))  # [B, Hk, L * G, D]
    return out.view(b, hk, n, g, d).permute(0, 2, 1, 3, 4).reshape(b, n, hq, d).float()


def rope_rows(cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[T, 1, D]`` cos and sign-folded sin rows `_rotate` takes, for `positions` of the cos|sin table."""
    half = cos_sin.shape[-1] // 2
    rows = cos_sin[positions][:, None, :]
    cos, sin = rows[..., :half], rows[..., half:]
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def decode_context(meta: BatchMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows ``[B, max_seq_len]`` of every context position of a decode batch (padded past each context with
    its last block's rows, or the table's padding) and the mask ``[B, 1, 1, max_seq_len]`` of the real ones."""
    position = torch.arange(meta.max_seq_len, device=meta.block_tables.device)
    blocks = meta.block_tables[:, : -(-meta.max_seq_len // block_size)].long()
    slots = blocks[:, position // block_size] * block_size + position % block_size
    return slots, (position[None, :] < meta.seq_lens[:, None])[:, None, None, :]
