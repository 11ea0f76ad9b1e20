"""The decoder: one forward over a ragged batch, for llama / mistral / qwen2 / qwen3 through config flags."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpullama.config import ModelConfig
from gpullama.ops import BatchMetadata, TorchOps, rope_cos_sin
from gpullama.quants import QTensor


@dataclass
class LayerWeights:
    """Prepared weights of one decoder layer (fused q|k|v and gate|up where their types agree)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: list  # one fused weight, or [q, k, v]
    qkv_bias: torch.Tensor | None
    o: object
    gate_up: list  # one fused weight, or [gate, up]
    down: object
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def unpermute_qk_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (it interleaves the two rotary halves of each head)."""
    head_dim = rows // num_heads
    half = head_dim // 2
    head = torch.arange(num_heads)[:, None, None]
    side = torch.arange(2)[None, :, None]
    pair = torch.arange(half)[None, None, :]
    # original row head*D + side*half + pair was written at head*D + 2*pair + side
    return (head * head_dim + 2 * pair + side).reshape(-1)


def concat_rows(parts: list[QTensor]) -> QTensor | None:
    """Stack weights along the output rows when they share a type (so one matmul serves them all)."""
    if len({p.qtype for p in parts}) != 1 or len({p.shape[1:] for p in parts}) != 1:
        return None
    data = torch.cat([p.data for p in parts], dim=0)
    return QTensor(data=data, qtype=parts[0].qtype, shape=(sum(p.shape[0] for p in parts), *parts[0].shape[1:]))


class Decoder:
    """Weights prepared for one ops backend, and the forward pass of one engine step."""

    def __init__(self, config: ModelConfig, tensors: dict[str, QTensor], ops: TorchOps, max_positions: int):
        self.config = config
        self.ops = ops
        device = ops.device

        def dense(name: str) -> torch.Tensor:
            return tensors[name].dequantize(torch.float32).to(device)

        def qk(name: str, heads: int) -> QTensor:
            t = tensors[name]
            return t.take_rows(unpermute_qk_rows(t.shape[0], heads)) if config.permuted_qk else t

        def qk_bias(name: str, heads: int) -> torch.Tensor:
            b = dense(name)
            return b[unpermute_qk_rows(b.shape[0], heads).to(device)] if config.permuted_qk else b

        def fused(parts: list[QTensor]) -> list:
            joined = concat_rows(parts)
            return [ops.prepare_weight(joined)] if joined is not None else [ops.prepare_weight(p) for p in parts]

        c = config
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"blk.{i}."
            q = qk(p + "attn_q.weight", c.num_heads)
            k = qk(p + "attn_k.weight", c.num_kv_heads)
            bias = None
            if c.attention_bias:
                bias = torch.cat(
                    [
                        qk_bias(p + "attn_q.bias", c.num_heads),
                        qk_bias(p + "attn_k.bias", c.num_kv_heads),
                        dense(p + "attn_v.bias"),
                    ]
                )
            self.layers.append(
                LayerWeights(
                    attn_norm=dense(p + "attn_norm.weight"),
                    ffn_norm=dense(p + "ffn_norm.weight"),
                    qkv=fused([q, k, tensors[p + "attn_v.weight"]]),
                    qkv_bias=bias,
                    o=ops.prepare_weight(tensors[p + "attn_output.weight"]),
                    gate_up=fused([tensors[p + "ffn_gate.weight"], tensors[p + "ffn_up.weight"]]),
                    down=ops.prepare_weight(tensors[p + "ffn_down.weight"]),
                    q_norm=dense(p + "attn_q_norm.weight") if c.qk_norm else None,
                    k_norm=dense(p + "attn_k_norm.weight") if c.qk_norm else None,
                )
            )
        self.embedding = ops.prepare_embedding(tensors["token_embd.weight"])
        self.output_norm = dense("output_norm.weight")
        head = tensors["token_embd.weight" if c.tied_embeddings else "output.weight"]
        self.output = ops.prepare_weight(head)
        freq_factors = tensors["rope_freqs.weight"].dequantize(torch.float32) if "rope_freqs.weight" in tensors else None
        self.cos_sin = rope_cos_sin(c.head_dim, max_positions, c.rope_base, freq_factors).to(device)
        self.scale = c.head_dim**-0.5

    def _linear_parts(self, x: torch.Tensor, parts: list, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(parts) == 1:
            return self.ops.linear(x, parts[0], bias)
        out = torch.cat([self.ops.linear(x, w) for w in parts], dim=-1)
        return out + bias if bias is not None else out

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, meta: BatchMetadata, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """Run the batch's tokens through the decoder, writing their k/v into the pool; logits of `meta.logits_indices`."""
        c, ops = self.config, self.ops
        t = token_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        hidden = ops.embedding(token_ids, self.embedding)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = ops.rms_norm(hidden, layer.attn_norm, c.rms_eps, residual)
            qkv = self._linear_parts(x, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_size].view(t, c.num_heads, c.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size :].view(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = ops.head_rms_norm(q, layer.q_norm, c.rms_eps)
                k = ops.head_rms_norm(k, layer.k_norm, c.rms_eps)
            q, k = ops.rope_and_cache(q, k, v, self.cos_sin, k_caches[i], v_caches[i], meta)
            attn = ops.attention(q, k_caches[i], v_caches[i], meta, self.scale)
            hidden = ops.linear(attn.reshape(t, q_size), layer.o)
            x, residual = ops.rms_norm(hidden, layer.ffn_norm, c.rms_eps, residual)
            hidden = ops.linear(ops.silu_mul(self._linear_parts(x, layer.gate_up)), layer.down)
        x, _ = ops.rms_norm(hidden[meta.logits_indices], self.output_norm, c.rms_eps, residual[meta.logits_indices])
        return ops.linear(x, self.output).float()
