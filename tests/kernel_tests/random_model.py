"""Random-weight decoders built straight on a device (no file): the GPU check's Llama-3.2-1B shapes and tiny ones.

Random bytes are valid GGUF blocks once their f16 scale fields are set to small finite values; the values are
chosen so weights have a spread near 0.02, like a trained model's, and activations stay moderate.
"""

from __future__ import annotations

import gguf
import torch

from gpullama.config import ModelConfig
from gpullama.ops import BatchMetadata
from gpullama.quants import QTensor

Q = gguf.GGMLQuantizationType

SCALE_FIELDS = {
    Q.Q8_0: ((0, -3e-4, 3e-4),),
    Q.Q4_0: ((0, -5e-3, 5e-3),),
    Q.Q4_1: ((0, -5e-3, 5e-3), (2, -0.04, 0.0)),
    Q.Q5_0: ((0, -2e-3, 2e-3),),
    Q.Q5_K: ((0, 1e-5, 3e-5), (2, 1e-5, 3e-5)),
    Q.Q4_K: ((0, 2e-5, 6e-5), (2, 2e-5, 6e-5)),
    Q.Q6_K: ((208, 1e-5, 3e-5),),
    Q.MXFP4: (),  # its scale is the E8M0 exponent byte: MXFP4_EXPONENTS
}
"""f16 fields of each block type: (byte offset, low, high), drawn uniformly (weights of a trained model's spread)."""
MXFP4_EXPONENTS = (119, 121)
"""MXFP4's exponent byte, drawn uniformly in this range: scales 2^-9 .. 2^-7, weights of a trained model's spread."""


def llama_1b_config(num_layers: int = 16) -> ModelConfig:
    """Llama-3.2-1B shapes (hidden 2048, 32 heads, 8 kv heads, head dim 64, intermediate 8192, vocab 128256)."""
    return ModelConfig("llama", num_layers, 2048, 8192, 32, 8, 64, 128256, 131072, 500000.0, 1e-5)


def tiny_config(num_layers: int = 1, vocab_size: int = 72, intermediate_size: int = 256) -> ModelConfig:
    """A tiny llama whose every matmul input dim is a multiple of 256 (the K-quant block)."""
    return ModelConfig("llama", num_layers, 256, intermediate_size, 4, 2, 64, vocab_size, 512, 10000.0, 1e-5)


def random_weight(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, device: torch.device, g: torch.Generator) -> QTensor:
    """A random valid `[rows, cols]` weight of `qtype`, generated on `device`."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
        values = torch.randn(rows, cols, device=device, generator=g) * 0.02
        return QTensor(values.to(dtype), qtype, (rows, cols))
    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    blocks = torch.randint(0, 256, (n_blocks, size), device=device, dtype=torch.uint8, generator=g)
    for offset, low, high in SCALE_FIELDS[qtype]:
        field = torch.rand(n_blocks, 1, device=device, generator=g) * (high - low) + low
        blocks[:, offset : offset + 2] = field.half().view(torch.uint8)
    if qtype == Q.MXFP4:
        low, high = MXFP4_EXPONENTS
        blocks[:, 0] = torch.randint(low, high + 1, (n_blocks,), device=device, dtype=torch.uint8, generator=g)
    return QTensor(blocks.view(rows, -1), qtype, (rows, cols))


def random_experts(qtype: gguf.GGMLQuantizationType, experts: int, rows: int, cols: int, device: torch.device,
                   g: torch.Generator) -> QTensor:
    """`experts` stacked random `[rows, cols]` weights of `qtype`: ``[experts, rows, cols]``."""
    w = random_weight(qtype, experts * rows, cols, device, g)
    return QTensor(w.data.view(experts, rows, -1), qtype, (experts, rows, cols))


def qwen3_moe_config(num_layers: int = 48, num_experts: int = 128) -> ModelConfig:
    """Qwen3-30B-A3B shapes (hidden 2048, 32 heads, 4 kv heads, head dim 128, 8 of 128 experts of 768 rows, q/k
    norms, vocab 151936); fewer layers or experts to fit a smaller machine."""
    return ModelConfig(
        "qwen3moe", num_layers, 2048, 6144, 32, 4, 128, 151936, 40960, 1e6, 1e-6, qk_norm=True, num_experts=num_experts,
        num_experts_used=8, expert_intermediate_size=768, expert_weights_norm=True,
    )


def gpt_oss_like_config(vocab_size: int = 72) -> ModelConfig:
    """gpt-oss's flags on a tiny shape: 4 experts (2 a token) with biases and clamped SwiGLU, softmax of the top
    logits, attention sinks, q/k/v/o biases, YaRN (unrounded ramp), a window on the first of two layers."""
    return ModelConfig(
        "gpt-oss", 2, 128, 128, 4, 2, 32, vocab_size, 512, 150000.0, 1e-5, attention_bias=True, attn_output_bias=True,
        attn_sinks=True, sliding_window=4, swa_layers=(True, False), ffn_norm_tensor="post_attention_norm",
        rope_scale=4.0, rope_yarn=True, rope_yarn_truncate=False, rope_original_context=32, num_experts=4,
        num_experts_used=2, expert_intermediate_size=64, expert_gating="softmax_topk", expert_activation="swiglu_oai",
    )


def deepseek_v2_lite_config(num_layers: int = 27) -> ModelConfig:
    """DeepSeek-V2-Lite shapes (hidden 2048, 16 heads of 128 + 64 rope key dims and 128 value dims over a latent
    row of 512 + 64, 6 of 64 experts of 1408 rows and a shared expert of 2816, vocab 102400); every layer MoE."""
    return ModelConfig(
        "deepseek2", num_layers, 2048, 10944, 16, 1, 576, 102400, 32768, 10000.0, 1e-6, rotary_dim=64,
        kv_lora_rank=512, qk_nope_dim=128, v_head_dim=128, attention_scale=192**-0.5, num_experts=64,
        num_experts_used=6, expert_intermediate_size=1408, shared_expert_intermediate_size=2816,
        expert_weights_scale=1.0,
    )


def mla_like_config(vocab_size: int = 72) -> ModelConfig:
    """DeepSeek-V3's flags on a tiny shape: latent attention with a query bottleneck (4 heads of 32 + 32 rope key
    dims, 32 value dims, a latent row of 64 + 32), 2 of 4 experts by sigmoid + correction bias in 2 groups, a
    shared expert."""
    return ModelConfig(
        "deepseek2", 2, 256, 256, 4, 1, 96, vocab_size, 512, 10000.0, 1e-6, rotary_dim=32, kv_lora_rank=64,
        q_lora_rank=64, qk_nope_dim=32, v_head_dim=32, attention_scale=64**-0.5, num_experts=4, num_experts_used=2,
        expert_intermediate_size=64, shared_expert_intermediate_size=64, expert_gating="sigmoid", expert_groups=2,
        expert_weights_norm=True, expert_weights_scale=2.5,
    )


def lfm2_1b_config(num_layers: int = 16) -> ModelConfig:
    """LFM2-1.2B shapes (hidden 2048, 10 short-convolution layers of kernel 3 and 6 attention layers of 32 heads, 8
    kv heads of 64, q/k norms, intermediate 8192, vocab 65536, tied embeddings); fewer layers keep its pattern."""
    attention = {2, 5, 8, 10, 12, 14}
    return ModelConfig(
        "lfm2", num_layers, 2048, 8192, 32, 8, 64, 65536, 128000, 1e6, 1e-5, qk_norm=True, tied_embeddings=True,
        conv_layers=tuple(i not in attention for i in range(num_layers)), conv_kernel=3,
        output_norm_tensor="token_embd_norm",
    )


def lfm2_like_config(vocab_size: int = 72) -> ModelConfig:
    """LFM2's flags on a tiny shape: two short-convolution layers (kernel 3) around an attention layer with q/k
    norms, the final norm as token_embd_norm."""
    return ModelConfig(
        "lfm2", 3, 256, 256, 4, 2, 64, vocab_size, 512, 1e6, 1e-5, qk_norm=True, tied_embeddings=True,
        conv_layers=(True, False, True), conv_kernel=3, output_norm_tensor="token_embd_norm",
    )


def qwen35_08b_config(num_layers: int = 24) -> ModelConfig:
    """Qwen3.5-0.8B shapes (hidden 1024; three gated delta-net layers of 16 key and 16 value heads of 128, kernel 4,
    then a gated attention layer of 8 heads and 2 kv heads of 256 with 64 rotary dims and q/k norms; intermediate
    3584, vocab 248320, tied embeddings); fewer layers keep its pattern."""
    return ModelConfig(
        "qwen35", num_layers, 1024, 3584, 8, 2, 256, 248320, 262144, 1e7, 1e-6, qk_norm=True, tied_embeddings=True,
        rotary_dim=64, ffn_norm_tensor="post_attention_norm", attn_output_gate=True, conv_kernel=4,
        delta_layers=tuple((i + 1) % 4 != 0 for i in range(num_layers)), ssm_state_size=128, ssm_groups=16,
        ssm_heads=16, ssm_inner_size=2048,
    )


def qwen35_like_config(vocab_size: int = 72) -> ModelConfig:
    """Qwen3.5's flags on a tiny shape: a gated delta-net layer (2 key heads for 4 value heads of 64, kernel 4), then
    a gated attention layer with q/k norms and partial rotary (16 of 64 dims)."""
    return ModelConfig(
        "qwen35", 2, 256, 256, 4, 2, 64, vocab_size, 512, 1e7, 1e-6, qk_norm=True, tied_embeddings=True, rotary_dim=16,
        ffn_norm_tensor="post_attention_norm", attn_output_gate=True, conv_kernel=4, delta_layers=(True, False),
        ssm_state_size=64, ssm_groups=2, ssm_heads=4, ssm_inner_size=256,
    )


def granite_h_350m_config(num_layers: int = 32) -> ModelConfig:
    """Granite-4.0-H-350M-like shapes (hidden 768; Mamba2 layers of 48 heads of 32 dims in one group, state 128,
    kernel 4, and 4 attention layers of 12 heads, 4 kv heads of 64, without rotary; a dense MLP of 2048, vocab
    100352; Granite's multipliers); fewer layers keep a pattern of one attention layer in eight."""
    return ModelConfig(
        "granitehybrid", num_layers, 768, 2048, 12, 4, 64, 100352, 32768, 1e4, 1e-5, permuted_qk=True,
        nope_layers=(True,) * num_layers, attention_scale=1 / 64, embedding_scale=12.0, residual_scale=0.25,
        logit_scale=3.0, conv_kernel=4, mamba_layers=tuple(i % 8 != 3 for i in range(num_layers)),
        ssm_state_size=128, ssm_groups=1, ssm_heads=48, ssm_inner_size=1536,
    )


def granite_hybrid_like_config(vocab_size: int = 72) -> ModelConfig:
    """Granite 4.0-H's flags on a tiny shape: a Mamba2 layer (4 heads of 32 in 2 groups, state 64, kernel 4), then
    an attention layer without rotary, 2 of 4 experts (renormalized) beside a shared expert, the four
    multipliers."""
    return ModelConfig(
        "granitehybrid", 2, 64, 64, 4, 2, 16, vocab_size, 512, 1e4, 1e-6, permuted_qk=True,
        nope_layers=(True, True), attention_scale=0.2, embedding_scale=1.5, residual_scale=0.7, logit_scale=2.0,
        conv_kernel=4, mamba_layers=(True, False), ssm_state_size=64, ssm_groups=2, ssm_heads=4, ssm_inner_size=128,
        num_experts=4, num_experts_used=2, expert_intermediate_size=64, shared_expert_intermediate_size=96,
        expert_weights_norm=True,
    )


def gemma_like_config(vocab_size: int = 72) -> ModelConfig:
    """Every Gemma flag at once on a tiny shape: q/k norms, post-norms, GeGLU, embedding scale, a sliding layer
    (window 4, its own rope base) beside a full one (linear rope scaling), attention and final soft-capping."""
    return ModelConfig(
        "gemma3", 2, 256, 256, 4, 2, 64, vocab_size, 512, 1e6, 1e-6, qk_norm=True, tied_embeddings=True,
        rope_scale=8.0, rope_base_swa=1e4, sliding_window=4, swa_layers=(True, False), attention_scale=0.1,
        attn_softcap=20.0, embedding_scale=16.0, final_softcap=15.0, post_norms=True, activation="gelu_tanh",
    )


def phi_granite_like_config(vocab_size: int = 72) -> ModelConfig:
    """Phi-3's partial rotary (32 of 64 dims) with a LongRoPE attention factor and a window on every layer, and
    Granite's four multipliers (embedding, residual, attention, logits), on a tiny shape."""
    return ModelConfig(
        "phi3", 2, 256, 256, 4, 2, 64, vocab_size, 512, 1e4, 1e-5, rotary_dim=32, rope_attn_factor=1.2,
        sliding_window=5, swa_layers=(True, True), attention_scale=0.05, embedding_scale=3.0, residual_scale=0.5,
        logit_scale=4.0,
    )


def random_tensors(
    config: ModelConfig, qtype: gguf.GGMLQuantizationType, device: torch.device, seed: int = 0, fused: bool = False,
    expert_qtype: gguf.GGMLQuantizationType | None = None,
) -> dict[str, QTensor]:
    """GGUF-named tensors of a random decoder: matmul weights (and the embedding) in `qtype`, norms in F32; the
    config's q/k norms and post-norms when it has them, no output.weight when tied, with `fused` phi3's
    stored attn_qkv and gate|up ffn_up instead of the separate matrices, and a MoE config's router and stacked
    experts (in `expert_qtype`) with gpt-oss's biases and sinks where it has them."""
    g = torch.Generator(device=device).manual_seed(seed)
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def norm(n: int) -> QTensor:
        return QTensor(1.0 + 0.1 * torch.randn(n, device=device, generator=g), Q.F32, (n,))

    def vector(*shape: int, scale: float = 0.1) -> QTensor:
        return QTensor(scale * torch.randn(*shape, device=device, generator=g), Q.F32, shape)

    tensors = {
        "token_embd.weight": random_weight(qtype, c.vocab_size, c.hidden_size, device, g),
        c.output_norm_tensor + ".weight": norm(c.hidden_size),
    }
    if not c.tied_embeddings:
        tensors["output.weight"] = random_weight(qtype, c.vocab_size, c.hidden_size, device, g)
    for i in range(c.num_layers):
        p = f"blk.{i}."
        if c.is_mla:  # latent attention in place of q/k/v (attn_k_b, attn_v_b: F16, per head)
            h, lora, r = c.num_heads, c.kv_lora_rank, c.rotary_dim
            q_rows = h * (c.qk_nope_dim + r)
            if c.q_lora_rank:
                tensors[p + "attn_q_a.weight"] = random_weight(qtype, c.q_lora_rank, c.hidden_size, device, g)
                tensors[p + "attn_q_a_norm.weight"] = norm(c.q_lora_rank)
                tensors[p + "attn_q_b.weight"] = random_weight(qtype, q_rows, c.q_lora_rank, device, g)
            else:
                tensors[p + "attn_q.weight"] = random_weight(qtype, q_rows, c.hidden_size, device, g)
            tensors[p + "attn_kv_a_mqa.weight"] = random_weight(qtype, lora + r, c.hidden_size, device, g)
            tensors[p + "attn_kv_a_norm.weight"] = norm(lora)
            tensors[p + "attn_k_b.weight"] = random_experts(Q.F16, h, lora, c.qk_nope_dim, device, g)
            tensors[p + "attn_v_b.weight"] = random_experts(Q.F16, h, c.v_head_dim, lora, device, g)
            q_rows = h * c.v_head_dim  # the output projection's input
        if c.is_conv(i):  # a short convolution in place of attention
            h = c.hidden_size
            tensors[p + "shortconv.in_proj.weight"] = random_weight(qtype, 3 * h, h, device, g)
            tensors[p + "shortconv.out_proj.weight"] = random_weight(qtype, h, h, device, g)
            tensors[p + "shortconv.conv.weight"] = vector(h, c.conv_kernel, scale=0.5)
        if c.is_delta(i):  # a gated delta-net in place of attention (its small vectors F32, as the converter writes)
            h, hv, channels, inner = c.hidden_size, c.ssm_heads, c.delta_conv_channels, c.ssm_inner_size
            tensors[p + "attn_qkv.weight"] = random_weight(qtype, channels, h, device, g)
            tensors[p + "attn_gate.weight"] = random_weight(qtype, inner, h, device, g)
            tensors[p + "ssm_beta.weight"] = random_weight(qtype, hv, h, device, g)
            tensors[p + "ssm_alpha.weight"] = random_weight(qtype, hv, h, device, g)
            tensors[p + "ssm_conv1d.weight"] = vector(channels, c.conv_kernel, scale=0.5)
            tensors[p + "ssm_a"] = QTensor(-torch.rand(hv, device=device, generator=g) - 0.1, Q.F32, (hv,))
            tensors[p + "ssm_dt.bias"] = vector(hv)
            tensors[p + "ssm_norm.weight"] = norm(inner // hv)
            tensors[p + "ssm_out.weight"] = random_weight(qtype, h, inner, device, g)
        if c.is_mamba(i):  # a Mamba2 layer in place of attention (its small vectors F32, as the converter writes)
            h, heads, channels, inner = c.hidden_size, c.ssm_heads, c.delta_conv_channels, c.ssm_inner_size
            tensors[p + "ssm_in.weight"] = random_weight(qtype, inner + channels + heads, h, device, g)
            tensors[p + "ssm_conv1d.weight"] = vector(channels, c.conv_kernel, scale=0.5)
            tensors[p + "ssm_conv1d.bias"] = vector(channels)
            tensors[p + "ssm_a"] = QTensor(-torch.rand(heads, 1, device=device, generator=g) - 0.1, Q.F32, (heads, 1))
            tensors[p + "ssm_d"] = QTensor(torch.rand(heads, 1, device=device, generator=g), Q.F32, (heads, 1))
            tensors[p + "ssm_dt.bias"] = vector(heads)
            tensors[p + "ssm_norm.weight"] = QTensor(1.0 + 0.1 * torch.randn(c.ssm_groups, inner // c.ssm_groups,
                                                                              device=device, generator=g),
                                                     Q.F32, (c.ssm_groups, inner // c.ssm_groups))
            tensors[p + "ssm_out.weight"] = random_weight(qtype, h, inner, device, g)
        if fused:
            shapes = {
                "attn_qkv.weight": (q_rows + 2 * kv_rows, c.hidden_size),
                "ffn_up.weight": (2 * c.intermediate_size, c.hidden_size),
            }
        else:
            shapes = {
                "attn_q.weight": (q_rows, c.hidden_size),
                "attn_k.weight": (kv_rows, c.hidden_size),
                "attn_v.weight": (kv_rows, c.hidden_size),
                "ffn_gate.weight": (c.intermediate_size, c.hidden_size),
                "ffn_up.weight": (c.intermediate_size, c.hidden_size),
            }
        if c.is_mla or not c.has_attention(i):
            for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight"):
                shapes.pop(name, None)
        elif c.attn_output_gate:  # each head's query rows, then its gate's
            shapes["attn_q.weight"] = (2 * q_rows, c.hidden_size)
        if c.is_mla or c.has_attention(i):
            shapes["attn_output.weight"] = (c.hidden_size, q_rows)
        shapes["ffn_down.weight"] = (c.hidden_size, c.intermediate_size)
        if c.is_moe:  # experts stacked (`expert_qtype`, default `qtype`); the router F32, as llama.cpp keeps it
            del shapes["ffn_gate.weight"], shapes["ffn_up.weight"], shapes["ffn_down.weight"]
            e, i, h = c.num_experts, c.expert_intermediate_size, c.hidden_size
            kind = expert_qtype or qtype
            tensors[p + "ffn_gate_exps.weight"] = random_experts(kind, e, i, h, device, g)
            tensors[p + "ffn_up_exps.weight"] = random_experts(kind, e, i, h, device, g)
            tensors[p + "ffn_down_exps.weight"] = random_experts(kind, e, h, i, device, g)
            tensors[p + "ffn_gate_inp.weight"] = vector(e, h, scale=0.05)
            if c.shared_expert_intermediate_size:  # always on (DeepSeek), beside the routed ones
                s = c.shared_expert_intermediate_size
                tensors[p + "ffn_gate_shexp.weight"] = random_weight(qtype, s, h, device, g)
                tensors[p + "ffn_up_shexp.weight"] = random_weight(qtype, s, h, device, g)
                tensors[p + "ffn_down_shexp.weight"] = random_weight(qtype, h, s, device, g)
            if c.expert_gating == "sigmoid":  # the choice's correction bias
                tensors[p + "exp_probs_b.bias"] = vector(e)
            if c.expert_activation == "swiglu_oai":  # gpt-oss's biases
                tensors[p + "ffn_gate_inp.bias"] = vector(e)
                tensors[p + "ffn_gate_exps.bias"], tensors[p + "ffn_up_exps.bias"] = vector(e, i), vector(e, i)
                tensors[p + "ffn_down_exps.bias"] = vector(e, h, scale=0.01)
        if c.attention_bias:
            for name, rows in (("attn_q.bias", q_rows), ("attn_k.bias", kv_rows), ("attn_v.bias", kv_rows)):
                tensors[p + name] = vector(rows)
        if c.attn_output_bias:
            tensors[p + "attn_output.bias"] = vector(c.hidden_size, scale=0.01)
        if c.attn_sinks:
            tensors[p + "attn_sinks.weight"] = vector(c.num_heads, scale=1.0)
        for name, (rows, cols) in shapes.items():
            tensors[p + name] = random_weight(qtype, rows, cols, device, g)
        names = ["attn_norm.weight", c.ffn_norm_tensor + ".weight"]
        names += ["post_attention_norm.weight", "post_ffw_norm.weight"] if c.post_norms else []
        for name in names:
            tensors[p + name] = norm(c.hidden_size)
        if c.qk_norm and not c.is_mla and c.has_attention(i):
            tensors[p + "attn_q_norm.weight"] = norm(c.head_dim)
            tensors[p + "attn_k_norm.weight"] = norm(c.head_dim)
    return tensors


def batch_metadata(seq_lens: list[int], q_lens: list[int], block_size: int, device: torch.device) -> BatchMetadata:
    """Metadata of sequences i owning blocks ``i * blocks_per_seq ...``, their last q_lens tokens new."""
    per_seq = max(-(-s // block_size) for s in seq_lens)
    positions, slots, starts = [], [], [0]
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        positions += range(seq_len - q_len, seq_len)
        slots += [i * per_seq * block_size + p for p in range(seq_len - q_len, seq_len)]
        starts.append(starts[-1] + q_len)
    tables = torch.arange(len(seq_lens) * per_seq, dtype=torch.int32).view(len(seq_lens), per_seq)
    return BatchMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        logits_indices=torch.tensor(starts[1:], dtype=torch.int64, device=device) - 1,
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


GEMMA3_4B_TOWER = dict(image_size=896, patch_size=14, embedding_length=1152, feed_forward_length=4304, block_count=27,
                       head_count=16, projection_dim=2560, scale_factor=4)
"""Gemma-3-4B's mmproj (SigLIP so400m: 896-pixel images of 14-pixel patches, 27 blocks of 1152 wide with 16 heads of
72, an MLP of 4304, the 64x64 patch grid pooled 4x4 to 256 tokens of the text model's 2560)."""
TINY_TOWER = dict(image_size=56, patch_size=14, embedding_length=64, feed_forward_length=128, block_count=2,
                  head_count=2, projection_dim=64, scale_factor=2)
"""A Gemma 3 tower on toy shapes: 4x4 patches pooled 2x2 to 4 tokens, 2 blocks of 2 heads of 32."""


def random_gemma3_tower(shape: dict, qtype: gguf.GGMLQuantizationType, device: torch.device, seed: int = 0):
    """A Gemma 3 mmproj of `shape` (`GEMMA3_4B_TOWER`, `TINY_TOWER`) built on `device` with random weights, as
    `gpullama.vision.tower.VisionTower(path, ops, model)` takes it: an object with the file's ``metadata`` and its
    ``tensors`` (the blocks' matrices in `qtype`, norms near 1, the rest float32)."""
    from types import SimpleNamespace

    g = torch.Generator(device=device).manual_seed(seed)
    d, f, p = shape["embedding_length"], shape["feed_forward_length"], shape["patch_size"]
    patches = (shape["image_size"] // p) ** 2
    meta = {"general.architecture": "clip", "clip.projector_type": "gemma3", "clip.vision.image_size": shape["image_size"],
            "clip.vision.patch_size": p, "clip.vision.embedding_length": d, "clip.vision.feed_forward_length": f,
            "clip.vision.block_count": shape["block_count"], "clip.vision.attention.head_count": shape["head_count"],
            "clip.vision.attention.layer_norm_epsilon": 1e-6, "clip.vision.image_mean": [0.5] * 3,
            "clip.vision.image_std": [0.5] * 3, "clip.vision.projection_dim": shape["projection_dim"],
            "clip.vision.projector.scale_factor": shape["scale_factor"]}

    def dense(*dims: int, scale: float = 0.02, centre: float = 0.0) -> QTensor:
        values = torch.randn(dims, device=device, generator=g) * scale + centre
        return QTensor(values, Q.F32, dims)

    tensors = {"v.patch_embd.weight": dense(d, 3, p, p), "v.patch_embd.bias": dense(d),
               "v.position_embd.weight": dense(patches, d), "v.post_ln.weight": dense(d, scale=0.1, centre=1.0),
               "v.post_ln.bias": dense(d), "mm.soft_emb_norm.weight": dense(d, scale=0.1, centre=1.0),
               "mm.input_projection.weight": dense(d, shape["projection_dim"])}
    for i in range(shape["block_count"]):
        b = f"v.blk.{i}."
        for name, rows, cols in (("attn_q", d, d), ("attn_k", d, d), ("attn_v", d, d), ("attn_out", d, d),
                                 ("ffn_up", f, d), ("ffn_down", d, f)):
            tensors[b + name + ".weight"] = random_weight(qtype, rows, cols, device, g)
            tensors[b + name + ".bias"] = dense(rows)
        for norm in ("ln1", "ln2"):
            tensors[b + norm + ".weight"], tensors[b + norm + ".bias"] = dense(d, scale=0.1, centre=1.0), dense(d)
    return SimpleNamespace(metadata=meta, tensors=tensors)
