"""Model configuration read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpullama.pooling_params import POOLING_TYPES

SUPPORTED_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "phi3", "granite", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "gpt-oss", "smollm3",
    "glm4moe", "deepseek2", "lfm2", "lfm2moe", "qwen35", "qwen35moe", "granitehybrid", "qwen2vl", "gemma4", "qwen3vl",
    "qwen3vlmoe",
)

_MOE_SUPPORTED = ("the mixture-of-experts families supported are qwen2moe, qwen3moe, qwen35moe, gpt-oss, glm4moe, "
                  "deepseek2, lfm2moe, granitehybrid and Mixtral (llama)")
# Families llama.cpp knows that are not implemented here, with why (named in the refusal).
_NOT_SUPPORTED = {
    "granitemoe": f"Granite MoE is not supported ({_MOE_SUPPORTED})",
    "phimoe": f"Phi-3.5-MoE is not supported ({_MOE_SUPPORTED})",
    "qwen3next": f"Qwen3-Next's linear attention is not supported ({_MOE_SUPPORTED})",
    "olmoe": f"OLMoE is not supported ({_MOE_SUPPORTED})",
    "gemma": "Gemma 1 is not supported (Gemma 2, 3 and 4 are)",
    "gemma3n": "Gemma 3n is not supported (Gemma 2, 3 and 4 are)",
}


@dataclass
class ModelConfig:
    """The shape and numerics of a decoder: one set of flags covering llama (and Mixtral), mistral, qwen2, qwen3,
    phi3 (Phi-3, Phi-3.5, Phi-4-mini), granite (Granite 3.x), gemma2, gemma3, qwen2moe, qwen3moe, gpt-oss, smollm3,
    glm4moe (GLM-4.5), deepseek2 (DeepSeek-V2/V3's multi-head latent attention), lfm2, lfm2moe (LFM2's short
    convolutions beside attention layers; the latter with routed experts after its leading dense layers), qwen35, qwen35moe (Qwen3.5's gated delta-net layers beside gated
    attention; the latter with routed experts and a gated shared expert) and granitehybrid (Granite 4.0's Mamba2
    layers beside attention without rotary embedding, routed experts with a shared one or a dense MLP)."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    rms_eps: float
    attention_bias: bool = False  # qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm on each q and k head
    tied_embeddings: bool = False  # no output.weight: the embedding doubles as the output head
    permuted_qk: bool = False  # llama.cpp's converter interleaved the Q/K rows (llama and granite)
    # rotary embedding
    rotary_dim: int = 0  # dims of each head that rotate (phi3 partial rotary); 0: all of head_dim
    rope_sections: tuple[int, ...] = ()  # qwen2vl's M-RoPE: frequencies of time, rows, columns (images' tokens)
    mrope_interleaved: bool = False  # qwen3vl: the sections' frequencies interleaved (t h w t h w ...), not in runs
    deepstack_layers: int = 0  # qwen3vl: an image token's embedding carries this many more, added after layers 0..
    rope_scale: float = 1.0  # linear rope scaling factor (positions divided by it) of the full-attention layers
    rope_attn_factor: float = 1.0  # LongRoPE's attention factor: cos and sin are multiplied by it (phi3)
    rope_original_context: int = 0  # LongRoPE: the long factors are used when the context exceeds this (phi3)
    rope_base_swa: float = 0.0  # rope base of the sliding-window layers (gemma3: 10000); 0: rope_base
    rope_scale_swa: float = 1.0  # linear rope scaling of the sliding-window layers
    nope_layers: tuple[bool, ...] = ()  # per layer: no rotary embedding (NoPE, smollm3); () when every layer rotates
    rope_interleaved: bool = False  # the file's rotary pairs are adjacent dims (llama.cpp's NORM type, deepseek2),
    # not halves: the rotary rows of q and k are reordered at load
    # attention
    sliding_window: int = 0  # a sliding layer attends to its last `sliding_window` positions; 0: none
    swa_layers: tuple[bool, ...] = ()  # per layer: sliding window (True) or full attention; () when none slide
    attention_scale: float = 0.0  # scale of q.k; 0: 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # gemma2: scores become cap * tanh(scores / cap); 0: off
    # residual stream and head
    embedding_scale: float = 1.0  # the embedding rows are multiplied by it (gemma: sqrt(hidden); granite)
    residual_scale: float = 1.0  # granite: each block's output is multiplied by it before the residual add
    logit_scale: float = 1.0  # granite: logits are divided by it
    final_softcap: float = 0.0  # gemma2: logits become cap * tanh(logits / cap); 0: off
    post_norms: bool = False  # gemma2/3: RMSNorm on the attention and MLP outputs before the residual add
    activation: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, gemma)
    pooling_type: str = "last"  # how an embedding pools the hidden states: `{arch}.pooling_type`, else last token
    # a reranker (pooling_type "rank"): its classification head's output labels (`{arch}.classifier.output_labels`)
    # and whether the head's outputs go through a softmax (qwen3: the yes/no logits, as llama.cpp's build_pooling)
    classifier_labels: tuple[str, ...] = ()
    rank_softmax: bool = False
    ffn_norm_tensor: str = "ffn_norm"  # the pre-MLP norm's tensor (gpt-oss: post_attention_norm)
    attn_output_bias: bool = False  # gpt-oss: the attention output projection carries a bias
    attn_sinks: bool = False  # gpt-oss: a learned sink logit per head joins each softmax (tensor attn_sinks)
    # YaRN rope scaling (rope.scaling.type "yarn"): frequencies mixed between interpolated (rope_scale) and
    # original by a ramp over the dims whose wavelengths lie between beta_fast and beta_slow rotations of the
    # original context; cos and sin multiplied by rope_attn_factor * (1 + 0.1 ln rope_scale)
    rope_yarn: bool = False
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_ext_factor: float = 1.0
    rope_yarn_truncate: bool = True  # the ramp's ends rounded to whole dims (gpt-oss: not, as its reference)
    # mixture of experts: layers with an ffn_gate_inp router run `num_experts_used` of `num_experts` experts
    num_experts: int = 0  # 0: a dense model
    num_experts_used: int = 0  # top-k
    expert_intermediate_size: int = 0  # rows of one expert's gate (and up) projection
    shared_expert_intermediate_size: int = 0  # qwen2moe: a shared expert beside the routed ones, sigmoid-gated
    expert_gating: str = "softmax"  # "softmax": top-k of softmax(router logits); "softmax_topk": softmax of the
    # top-k logits (gpt-oss); "sigmoid": top-k of sigmoid(router logits) (+ the layer's exp_probs_b for the choice
    # only: GLM-4.5, DeepSeek-V3)
    expert_groups: int = 1  # the experts in groups; a token chooses among the `expert_groups_used` groups of the best
    expert_groups_used: int = 1  # top-2 sums first (DeepSeek-V3's group-limited routing, as llama.cpp computes it)
    expert_weights_norm: bool = False  # the top-k weights renormalized to sum to 1 (qwen3moe, Mixtral)
    expert_weights_scale: float = 1.0  # the top-k weights multiplied by it
    expert_activation: str = "silu"  # "silu" (SwiGLU) or "swiglu_oai" (gpt-oss: clamped at swiglu_limit, with
    # silu's slope swiglu_alpha, times (up + 1))
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    nextn_layers: int = 0  # glm4moe: next-token-prediction layers after the decoder's (in block_count; loaded, unused)
    # multi-head latent attention (deepseek2): each token caches one row of `head_dim` = rotary_dim (its rotated key
    # part, shared by every head) + kv_lora_rank (its normalized latent, which doubles as every head's values)
    kv_lora_rank: int = 0  # 0: not MLA
    q_lora_rank: int = 0  # queries through a rank-q_lora_rank bottleneck (attn_q_a, attn_q_b); 0: one attn_q
    qk_nope_dim: int = 0  # each head's key dims without rotary (its rotary ones: rotary_dim)
    v_head_dim: int = 0  # each head's value dims (after attn_v_b)
    # short convolutions (lfm2): per layer, a gated depthwise causal convolution over the last `conv_kernel` tokens
    # in place of attention; its state (the last conv_kernel - 1 inputs) lives in a per-sequence slot
    conv_layers: tuple[bool, ...] = ()  # () when every layer attends
    conv_kernel: int = 0  # the causal convolution's width (lfm2's short convolutions, qwen35's delta-net inputs)
    output_norm_tensor: str = "output_norm"  # the final norm's tensor (lfm2: token_embd_norm, llama.cpp's name)
    # gated delta-net layers (qwen35): linear attention whose state, a [ssm_state_size, value dims] matrix per value
    # head, and its input convolution's last conv_kernel - 1 inputs live in a per-sequence slot; llama.cpp's
    # `ssm.*` keys give the sizes
    delta_layers: tuple[bool, ...] = ()  # () when no layer is one
    ssm_state_size: int = 0  # a key head's dims
    ssm_groups: int = 0  # key heads (each serves ssm_heads / ssm_groups value heads)
    ssm_heads: int = 0  # value heads
    ssm_inner_size: int = 0  # value heads x a value head's dims
    attn_output_gate: bool = False  # qwen35: each query head's rows are followed by a gate's; the attention output
    # is multiplied by sigmoid(gate) before o
    # Mamba2 layers (granitehybrid): a selective state-space scan whose state, a [ssm_state_size, head dims] matrix
    # per head, and its input convolution's last conv_kernel - 1 inputs live in a per-sequence slot; the same
    # `ssm.*` keys (ssm_heads: the scan's heads, ssm_groups: B/C groups, ssm_state_size: N, ssm_inner_size: heads x
    # head dims)
    mamba_layers: tuple[bool, ...] = ()  # () when no layer is one
    # Gemma 4: the sliding layers have heads of their own size and count, rotate their own dims (without the
    # rope_freqs factors, which are the full layers'), and the last `kv_shared_layers` layers cache nothing: each
    # attends over the K/V of the last earlier layer of its kind (`kv_source`)
    head_dim_swa: int = 0  # 0: head_dim
    num_kv_heads_swa: int = 0  # 0: num_kv_heads
    rotary_dim_swa: int = 0  # 0: rotary_dim
    kv_shared_layers: int = 0
    value_norm: bool = False  # gemma4: each value head RMS-normalized (no weight) before it is cached
    per_layer_input_size: int = 0  # gemma4: width of each layer's slice of the per-layer embeddings; 0: none
    pad_token_id: int = 0  # gemma4: an image row's per-layer input is this token's (`tokenizer.ggml.padding_token_id`)

    def __post_init__(self) -> None:
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep a KV pool (those with attention that cache their own K/V), in order."""
        return tuple(i for i in range(self.num_layers) if self.has_attention(i) and self.kv_source(i) == i)

    def kv_source(self, layer: int) -> int:
        """The layer whose KV pool `layer` attends over: itself, or (Gemma 4's last `kv_shared_layers` layers) the
        last layer before them of its kind (sliding or full), as llama.cpp's and transformers' KV sharing."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        for j in range(first_shared - 1, -1, -1):
            if self.is_sliding(j) == self.is_sliding(layer):
                return j
        raise ValueError(f"layer {layer} reuses the K/V of an earlier {'sliding' if self.is_sliding(layer) else 'full'}"
                         f"-attention layer, and none of the first {first_shared} layers is one")

    def layer_head_dim(self, layer: int) -> int:
        """Head dims of `layer`'s q, k and v (Gemma 4's sliding layers have their own)."""
        return self.head_dim_swa if self.head_dim_swa and self.is_sliding(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """KV heads of `layer` (Gemma 4's sliding layers have their own count)."""
        return self.num_kv_heads_swa if self.num_kv_heads_swa and self.is_sliding(layer) else self.num_kv_heads

    @property
    def input_embedding_size(self) -> int:
        """The width of an embedding given in place of a token's (an image's): the hidden size, times one more for
        each deepstack layer (llama.cpp's n_embd_inp)."""
        return self.hidden_size * (1 + self.deepstack_layers)

    @property
    def kv_values_per_token(self) -> int:
        """Values one token keeps in the KV pools: k and v of each layer in `kv_layers` (heads x head dims)."""
        return sum(2 * self.layer_kv_heads(i) * self.layer_head_dim(i) for i in self.kv_layers)

    @property
    def has_recurrent_state(self) -> bool:
        """Whether some layer keeps a per-sequence state (a recurrent layer: LFM2's short convolutions, Qwen3.5's
        gated delta-nets, Granite 4.0's Mamba2 layers)."""
        return any(self.conv_layers) or any(self.delta_layers) or any(self.mamba_layers)

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent states (float32, `state_shapes` of every layer; 0 without such layers)."""
        return 4 * sum(math.prod(shape) for i in range(self.num_layers) for shape in self.state_shapes(i))

    def is_conv(self, layer: int) -> bool:
        """Whether `layer` is a short convolution (no KV pool; a per-sequence state)."""
        return bool(self.conv_layers) and self.conv_layers[layer]

    def is_delta(self, layer: int) -> bool:
        """Whether `layer` is a gated delta-net (linear attention: no KV pool; a per-sequence state)."""
        return bool(self.delta_layers) and self.delta_layers[layer]

    def is_mamba(self, layer: int) -> bool:
        """Whether `layer` is a Mamba2 layer (a selective state-space scan: no KV pool; a per-sequence state)."""
        return bool(self.mamba_layers) and self.mamba_layers[layer]

    def has_attention(self, layer: int) -> bool:
        """Whether `layer` attends over a KV pool (not a recurrent layer)."""
        return not self.is_conv(layer) and not self.is_delta(layer) and not self.is_mamba(layer)

    @property
    def recurrent_layers_named(self) -> str:
        """The recurrent layers in words, for logs and refusals: "3 short-convolution layers" ("" without any)."""
        kinds = [(sum(self.conv_layers), "short-convolution"), (sum(self.delta_layers), "gated delta-net"),
                 (sum(self.mamba_layers), "Mamba2")]
        return " and ".join(f"{n} {kind} layer{'s' if n > 1 else ''}" for n, kind in kinds if n)

    @property
    def delta_conv_channels(self) -> int:
        """Channels of a delta-net layer's input convolution (its queries, keys and values), or of a Mamba2 layer's
        (its x, B and C): the same count."""
        return 2 * self.ssm_groups * self.ssm_state_size + self.ssm_inner_size

    def state_shapes(self, layer: int) -> list[tuple[int, ...]]:
        """The shapes of one sequence's recurrent states in `layer` (float32; [] for a layer with attention): a
        short convolution's last inputs; a delta-net's or Mamba2 layer's input convolution's last inputs and its state
        matrices ([heads, N, head dims])."""
        if self.is_conv(layer):
            return [(self.conv_kernel - 1, self.hidden_size)]
        if self.is_delta(layer) or self.is_mamba(layer):
            return [(self.conv_kernel - 1, self.delta_conv_channels),
                    (self.ssm_heads, self.ssm_state_size, self.ssm_inner_size // self.ssm_heads)]
        return []

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (the pool holds one latent row a token, no values)."""
        return self.kv_lora_rank > 0

    @property
    def separate_values(self) -> bool:
        """Whether the KV pool has a value pool beside the key pool (not for MLA: the values are in the key rows)."""
        return not self.is_mla

    @property
    def is_moe(self) -> bool:
        """Whether the model routes tokens to experts."""
        return self.num_experts > 0

    def is_nope(self, layer: int) -> bool:
        """Whether `layer` attends without rotary embedding (NoPE)."""
        return bool(self.nope_layers) and self.nope_layers[layer]

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends only to its last `sliding_window` positions."""
        return bool(self.swa_layers) and self.swa_layers[layer]

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], path: str = "") -> "ModelConfig":
        """Read the config of the architecture named in ``general.architecture``."""
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            why = f": {_NOT_SUPPORTED[arch]}" if arch in _NOT_SUPPORTED else ""
            raise ValueError(
                f"{path}: unsupported architecture {arch!r}{why} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"{path}: missing metadata key '{arch}.{key}'")
            return value

        def opt(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        kv_per_layer = kv_heads if isinstance(kv_heads, list) else None
        if kv_per_layer is not None:  # some files store one count per layer (0: a layer without attention, lfm2)
            counts = {int(n) for n in kv_per_layer if n}
            if arch == "gemma4":  # sliding and full layers' counts: `_gemma4` reads them
                counts = {max(counts)}
            if len(counts) != 1:
                raise ValueError(f"{path}: '{arch}.attention.head_count_kv' = {kv_per_layer}: layers with different "
                                 f"KV head counts are not supported")
            kv_heads = counts.pop()
        head_dim = int(opt("attention.key_length") or hidden // heads)
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = int(opt("vocab_size") or (len(tokens) if tokens else 0))
        nextn = int(opt("nextn_predict_layers") or 0)  # GLM-4.5's MTP layers: counted in block_count, never run
        num_layers = int(get("block_count")) - nextn
        config = cls(
            architecture=arch,
            num_layers=num_layers,
            hidden_size=hidden,
            # a model whose every layer routes (qwen35moe) may have no dense MLP size
            intermediate_size=_first(opt("feed_forward_length") or 0) if opt("expert_count") else
            _first(get("feed_forward_length")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            vocab_size=vocab,
            context_length=int(get("context_length", 2048)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            attention_bias=arch in ("qwen2", "qwen2moe", "gpt-oss", "qwen2vl"),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3moe", "qwen3vl", "qwen3vlmoe"),
            permuted_qk=arch in ("llama", "granite", "smollm3", "granitehybrid"),
            rotary_dim=int(opt("rope.dimension_count") or head_dim),
            nextn_layers=nextn,
        )
        pooling = opt("pooling_type")
        if pooling is not None:  # llama.cpp's values; "none" (per-token vectors) pools by the last token here
            kind = POOLING_TYPES.get(int(pooling), "last")
            config.pooling_type = "last" if kind == "none" else kind
        config.classifier_labels = tuple(str(v) for v in opt("classifier.output_labels") or ())
        config.rank_softmax = arch in _RANK_SOFTMAX
        if config.rotary_dim > head_dim or config.rotary_dim % 2:
            raise ValueError(
                f"{path}: '{arch}.rope.dimension_count' = {config.rotary_dim} must be even and at most the head "
                f"dim {head_dim}"
            )
        _read_rope_scaling(config, arch, opt, path)
        _read_experts(config, arch, opt, path)
        family = _FAMILIES.get(arch)
        if family is not None:
            family(config, get, opt, path)
        if config.per_layer_input_size:
            config.pad_token_id = int(meta.get("tokenizer.ggml.padding_token_id") or 0)
        return config


_RANK_SOFTMAX = ("qwen3",)
"""The families whose reranker head's outputs go through a softmax (llama.cpp's `build_pooling`: Qwen3-Reranker's
yes/no logits become the probability of each)."""

_YARN_LOG_MULTIPLIER = ("deepseek2",)
"""The families whose reader applies `rope.scaling.yarn_log_multiplier` (DeepSeek's softmax scale)."""


def _read_rope_scaling(config: ModelConfig, arch: str, opt, path: str) -> None:
    """`{arch}.rope.scaling.*`: linear scaling is applied; LongRoPE's factors are tensors (see `rope_factors`)."""
    kind = opt("rope.scaling.type")
    factor = float(opt("rope.scaling.factor") or 0.0)
    if kind in (None, "none") or (kind in ("linear", "yarn") and factor in (0.0, 1.0)):
        pass
    elif kind == "linear":
        config.rope_scale = factor
    elif kind == "yarn":
        config.rope_scale, config.rope_yarn = factor, True
        config.rope_yarn_beta_fast = float(opt("rope.scaling.yarn_beta_fast") or 32.0)
        config.rope_yarn_beta_slow = float(opt("rope.scaling.yarn_beta_slow") or 1.0)
        ext = opt("rope.scaling.yarn_ext_factor")
        config.rope_yarn_ext_factor = 1.0 if ext is None or float(ext) < 0 else float(ext)  # llama.cpp: -1 means 1
        if opt("rope.scaling.yarn_log_multiplier") and arch not in _YARN_LOG_MULTIPLIER:
            raise ValueError(f"{path}: '{arch}.rope.scaling.yarn_log_multiplier' (DeepSeek's YaRN) is only read for "
                             f"{', '.join(_YARN_LOG_MULTIPLIER)}")
    else:  # the rest change the rotation in ways not implemented here: refuse rather than be wrong
        raise ValueError(
            f"{path}: '{arch}.rope.scaling.type' = {kind!r} is not supported (linear and yarn rope scaling are)"
        )
    config.rope_scale_swa = config.rope_scale
    config.rope_attn_factor = float(opt("rope.scaling.attn_factor") or opt("rope.scaling.yarn_attn_factor") or 1.0)
    config.rope_original_context = int(opt("rope.scaling.original_context_length") or 0)
    if config.rope_yarn and not config.rope_original_context:
        raise ValueError(f"{path}: YaRN rope scaling needs '{arch}.rope.scaling.original_context_length'")


# llama.cpp's expert gating functions (`{arch}.expert_gating_func`): 1 softmax, 2 sigmoid, 3 softmax over the
# chosen experts' logits
_GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_topk"}


def _read_experts(config: ModelConfig, arch: str, opt, path: str) -> None:
    """`{arch}.expert_count` and the keys that shape routing, as llama.cpp's converter writes them; the expert
    sizes themselves come from the tensors (`gguf_file`)."""
    count = int(opt("expert_count") or 0)
    if arch in ("qwen2moe", "qwen3moe", "qwen35moe", "gpt-oss", "glm4moe", "lfm2moe", "qwen3vlmoe") and count <= 0:
        raise ValueError(f"{path}: missing metadata key '{arch}.expert_count' (a {arch} model routes to experts)")
    if count <= 0:
        return
    used = int(opt("expert_used_count") or 0)
    if not 0 < used <= count:
        raise ValueError(
            f"{path}: '{arch}.expert_used_count' = {opt('expert_used_count')} must be between 1 and "
            f"'{arch}.expert_count' = {count}"
        )
    groups = int(opt("expert_group_count") or 1)
    if groups > 1:
        groups_used = int(opt("expert_group_used_count") or 0)
        if count % groups or not 0 < groups_used <= groups or used > groups_used * (count // groups):
            raise ValueError(
                f"{path}: '{arch}.expert_group_count' = {groups} with '{arch}.expert_group_used_count' = "
                f"{opt('expert_group_used_count')}: the groups must divide the {count} experts and hold the "
                f"{used} chosen ones"
            )
        config.expert_groups, config.expert_groups_used = groups, groups_used
    config.num_experts, config.num_experts_used = count, used
    config.expert_intermediate_size = int(opt("expert_feed_forward_length") or config.intermediate_size)
    # a shared expert's rows: its own key (qwen2moe), else `expert_shared_count` experts' worth (GLM-4.5, DeepSeek)
    config.shared_expert_intermediate_size = int(
        opt("expert_shared_feed_forward_length") or int(opt("expert_shared_count") or 0) * config.expert_intermediate_size
    )
    # llama.cpp's graphs: qwen3moe, qwen35moe and Mixtral renormalize the top-k weights, qwen2moe does not; gpt-oss takes the
    # softmax of the chosen logits (normalized by construction); glm4moe's default is sigmoid
    default_gating = {"gpt-oss": 3, "glm4moe": 2}.get(arch, 1)
    gating = int(opt("expert_gating_func") or default_gating)
    if gating not in _GATING:
        raise ValueError(
            f"{path}: '{arch}.expert_gating_func' = {gating} is not supported (1: softmax, 2: sigmoid, 3: softmax of "
            f"the chosen experts' logits)"
        )
    config.expert_gating = _GATING[gating]
    norm = opt("expert_weights_norm")
    config.expert_weights_norm = bool(norm) if norm is not None else arch in ("llama", "qwen3moe", "qwen35moe",
                                                                              "granitehybrid", "lfm2moe", "gemma4",
                                                                              "qwen3vlmoe")
    config.expert_weights_scale = float(opt("expert_weights_scale") or 1.0)


def _first(value: Any) -> int:
    """A size the file gives once or per layer (Gemma 4's `feed_forward_length`): the first layer's."""
    return int(value[0] if isinstance(value, list) else value)


def _layer_pattern(num_layers: int, pattern: Any, key: str) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp's `set_swa_pattern`: with period n every n-th layer (the last of each
    group of n) has full attention; a list gives each layer's flag itself."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"'{key}' has {len(pattern)} entries for {num_layers} layers")
        return tuple(bool(p) for p in pattern)
    n = int(pattern)
    return tuple(n == 0 or i % n < n - 1 for i in range(num_layers))


def _phi3(config: ModelConfig, get, opt, path: str) -> None:
    """Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate|up tensors (read from the file), partial rotary, LongRoPE
    factors as tensors with their attention factor, and a sliding window on every layer where the file sets one
    (as transformers applies it; llama.cpp ignores it)."""
    window = int(get("attention.sliding_window", 0))
    if window > 0:
        config.sliding_window = window
        config.swa_layers = (True,) * config.num_layers


def _granite(config: ModelConfig, get, opt, path: str) -> None:
    """Granite 3.x: llama plus four multipliers (llama.cpp requires the logit scale; the others default to off)."""
    _granite_multipliers(config, opt)
    config.logit_scale = float(get("logit_scale"))
    if opt("rope.scaling.finetuned") is False:  # llama.cpp's switch for Granite without rotary embedding
        raise ValueError(
            f"{path}: '{config.architecture}.rope.scaling.finetuned' = false (Granite without rotary embedding) is not supported"
        )


def _granite_multipliers(config: ModelConfig, opt) -> None:
    """Granite's multipliers: logits divided by `logit_scale`, each block's output times `residual_scale`, the
    embedding times `embedding_scale`, q.k times `attention.scale` (llama.cpp: each off when absent)."""
    config.logit_scale = float(opt("logit_scale") or 1.0)
    config.residual_scale = float(opt("residual_scale") or 1.0)
    config.embedding_scale = float(opt("embedding_scale") or 1.0)
    config.attention_scale = float(opt("attention.scale") or 0.0)


def _granitehybrid(config: ModelConfig, get, opt, path: str) -> None:
    """Granite 4.0's hybrids (`granitehybrid`): Mamba2 layers (0 in `attention.head_count_kv`) beside attention
    layers without rotary embedding (`rope.scaling.finetuned` false, as the converter writes Granite 4.0-H; Bamba's
    rotary is refused), Granite's four multipliers, and routed experts (softmax top k, renormalized) with a shared
    expert, or (`expert_count` 0) a dense MLP. A Mamba2 layer: `ssm_in` gives z | x B C | dt (`ssm.inner_size` x
    values in `ssm.time_step_rank` heads, `ssm.group_count` groups of B and C with `ssm.state_size` values each),
    x B C through a causal convolution (`ssm_conv1d` with its bias, `ssm.conv_kernel` wide) and SiLU, the scan with
    ``dt = softplus(dt + ssm_dt.bias)``, decay ``exp(dt ssm_a)`` (the converter wrote -exp(A_log)) and input
    ``dt x B``, read out by C, plus ``ssm_d x``; then ``y silu(z)`` through an RMSNorm per group (`ssm_norm`) and
    `ssm_out`."""
    arch = config.architecture
    counts = get("attention.head_count_kv")
    if not isinstance(counts, list) or len(counts) != config.num_layers:
        raise ValueError(f"{path}: '{arch}.attention.head_count_kv' must give each of the {config.num_layers} layers' "
                         f"count (0 for a Mamba2 layer)")
    config.mamba_layers = tuple(int(n) == 0 for n in counts)
    config.conv_kernel = int(get("ssm.conv_kernel"))
    config.ssm_state_size = int(get("ssm.state_size"))
    config.ssm_groups = int(get("ssm.group_count"))
    config.ssm_heads = int(get("ssm.time_step_rank"))
    config.ssm_inner_size = int(get("ssm.inner_size"))
    if (config.conv_kernel < 2 or config.ssm_groups < 1 or config.ssm_heads < 1 or config.ssm_heads % config.ssm_groups
            or config.ssm_inner_size % config.ssm_heads or config.ssm_state_size < 1):
        raise ValueError(f"{path}: '{arch}.ssm.*' = conv kernel {config.conv_kernel}, {config.ssm_heads} heads, "
                         f"{config.ssm_groups} groups, state size {config.ssm_state_size}, inner size "
                         f"{config.ssm_inner_size}: the groups must divide the heads, the heads the inner size, and "
                         f"the kernel be at least 2")
    _granite_multipliers(config, opt)
    if opt("rope.scaling.finetuned") is not False:
        raise ValueError(f"{path}: '{arch}.rope.scaling.finetuned' is not false: a Granite hybrid with rotary "
                         f"embedding (Bamba) is not supported (Granite 4.0's attention layers have none)")
    config.nope_layers = (True,) * config.num_layers


def _gemma(config: ModelConfig, opt, default_window: int, default_pattern: int) -> None:
    """What Gemma 2 and Gemma 3 share: embedding x sqrt(hidden), post-norms, GeGLU, tied head, sliding layers."""
    config.embedding_scale = math.sqrt(config.hidden_size)
    config.post_norms = True
    config.activation = "gelu_tanh"
    window = int(opt("attention.sliding_window", default_window) or 0)
    if window > 0:
        config.sliding_window = window
        pattern = opt("attention.sliding_window_pattern", default_pattern)
        config.swa_layers = _layer_pattern(
            config.num_layers, pattern, f"{config.architecture}.attention.sliding_window_pattern"
        )
    # llama.cpp: 1 / sqrt(head_dim), except the 27B models (by layer count), which use hidden / heads
    big = {"gemma2": 46, "gemma3": 62}[config.architecture] == config.num_layers
    config.attention_scale = 1.0 / math.sqrt(config.hidden_size // config.num_heads if big else config.head_dim)


def _gemma2(config: ModelConfig, get, opt, path: str) -> None:
    """Gemma 2: attention-logit and final-logit soft-capping (llama.cpp's defaults 50 and 30), window 4096 on
    every other layer unless the file says otherwise."""
    _gemma(config, opt, default_window=4096, default_pattern=2)
    config.attn_softcap = float(opt("attn_logit_softcapping", 50.0))
    config.final_softcap = float(opt("final_logit_softcapping", 30.0))
    config.rope_base_swa = float(opt("rope.freq_base_swa", config.rope_base))


def _gemma3(config: ModelConfig, get, opt, path: str) -> None:
    """Gemma 3: q/k norms, five sliding layers (rope base 10000, unscaled) per full one (rope.freq_base, scaled)."""
    _gemma(config, opt, default_window=0, default_pattern=6)
    config.final_softcap = float(opt("final_logit_softcapping", 0.0) or 0.0)
    if config.sliding_window:
        config.rope_base_swa = float(opt("rope.freq_base_swa", 10000.0))
        config.rope_scale_swa = 1.0


def _gpt_oss(config: ModelConfig, get, opt, path: str) -> None:
    """gpt-oss: biases on q/k/v/o and the router, attention sinks, a sliding window on the even layers (llama.cpp's
    pattern 2), YaRN with unrounded ramp ends (as OpenAI's and transformers' references with the released config),
    clamped SwiGLU (alpha 1.702, limit 7: llama.cpp's constants), the pre-MLP norm in post_attention_norm."""
    window = int(get("attention.sliding_window"))
    if window > 0:
        config.sliding_window = window
        config.swa_layers = _layer_pattern(config.num_layers, 2, f"{config.architecture}.attention.sliding_window")
    config.ffn_norm_tensor = "post_attention_norm"
    config.expert_activation = "swiglu_oai"
    config.rope_yarn_truncate = False


def _smollm3(config: ModelConfig, get, opt, path: str) -> None:
    """SmolLM3: llama (Q/K permuted by the converter) with every fourth layer NoPE; llama.cpp fixes the interval at
    4 (`n_no_rope_layer_step`), the file has no key for it."""
    config.nope_layers = tuple((i + 1) % 4 == 0 for i in range(config.num_layers))


def _glm4moe(config: ModelConfig, get, opt, path: str) -> None:
    """GLM-4.5 (`glm4moe`): partial rotary (NeoX halves, as stored), q/k/v biases and (355B) q/k norms from the
    tensors, the pre-MLP norm in post_attention_norm, leading dense layers (the layers without a router), routed
    experts chosen by sigmoid + `exp_probs_b` (default gating: sigmoid) with a shared expert beside them; its
    next-token-prediction layer (`nextn_predict_layers`) is left out of the layers run."""
    config.ffn_norm_tensor = "post_attention_norm"
    if any(opt("rope.dimension_sections") or ()):
        raise ValueError(f"{path}: '{config.architecture}.rope.dimension_sections' (GLM-4.5V's multi-axis rotary) is "
                         f"not supported")


def _qwen2vl(config: ModelConfig, get, opt, path: str) -> None:
    """Qwen2-VL and Qwen2.5-VL's text model (`qwen2vl`): qwen2 with multi-axis rotary (M-RoPE,
    `rope.dimension_sections`: time, height, width); a text token has the same position on every axis, so the
    sections rotate as one plain rotary over the whole head (NeoX halves). An image's tokens take other positions on
    each axis (`gpullama.vision.rope_positions`), each frequency turning by its section's axis."""
    sections = [int(x) for x in opt("rope.dimension_sections") or ()]
    if sections and sum(sections) * 2 != config.rotary_dim:
        raise ValueError(f"{path}: '{config.architecture}.rope.dimension_sections' {sections} do not cover the "
                         f"{config.rotary_dim} rotary dims")
    config.rope_sections = tuple(sections)


def _qwen3vl(config: ModelConfig, get, opt, path: str) -> None:
    """Qwen3-VL's text model (`qwen3vl`; `qwen3vlmoe`: qwen3moe's experts): qwen3 (q/k norms, no biases) with
    interleaved M-RoPE (llama.cpp's IMROPE: frequency i turns by the row position when i % 3 == 1 and i < 3 x the
    rows' section, by the column position when i % 3 == 2 and i < 3 x the columns' section, else by the time
    position, as transformers' `apply_interleaved_mrope`) and deepstack: an image token's embedding from the mmproj
    is `n_deepstack_layers` + 1 embeddings side by side, the first its input, the k-th added to its hidden state
    after layer k - 1 (`gpullama.vision.qwen3_tower`)."""
    _qwen2vl(config, get, opt, path)
    config.mrope_interleaved = True
    config.deepstack_layers = int(opt("n_deepstack_layers") or 0)
    if not 0 <= config.deepstack_layers <= config.num_layers:
        raise ValueError(f"{path}: '{config.architecture}.n_deepstack_layers' = {config.deepstack_layers} must be "
                         f"between 0 and the {config.num_layers} layers")


def _lfm2(config: ModelConfig, get, opt, path: str) -> None:
    """LFM2 (`lfm2`): short-convolution layers (those with 0 in `attention.head_count_kv`) beside attention layers
    with q/k norms; a conv layer maps x to B, C and x' (`shortconv.in_proj`), convolves B * x' over the last
    `shortconv.l_cache` tokens per channel (`shortconv.conv`, causal), multiplies by C and projects
    (`shortconv.out_proj`). The final norm is `token_embd_norm` (llama.cpp's name). LFM2-MoE (`lfm2moe`): the same
    layers, their MLPs after the `leading_dense_block_count` dense ones routed: the top k of sigmoid(router logits)
    + `exp_probs_b` (the choice only), the chosen sigmoids renormalized (llama.cpp's graph; gating 2 as the converter
    writes it)."""
    arch = config.architecture
    counts = get("attention.head_count_kv")
    if not isinstance(counts, list) or len(counts) != config.num_layers:
        raise ValueError(f"{path}: '{arch}.attention.head_count_kv' must give each of the {config.num_layers} layers' "
                         f"count (0 for a short-convolution layer)")
    config.conv_layers = tuple(int(n) == 0 for n in counts)
    config.conv_kernel = int(get("shortconv.l_cache"))
    if config.conv_kernel < 2:
        raise ValueError(f"{path}: '{arch}.shortconv.l_cache' = {config.conv_kernel} must be at least 2")
    if opt("attention.sliding_window"):
        raise ValueError(f"{path}: '{arch}.attention.sliding_window' (LFM2 with sliding-window attention) is not "
                         f"supported")
    if opt("causal_attention") is False:
        raise ValueError(f"{path}: '{arch}.causal_attention' = false (a bidirectional LFM2 encoder) is not supported")
    config.output_norm_tensor = "token_embd_norm"


def _deepseek2(config: ModelConfig, get, opt, path: str) -> None:
    """DeepSeek-V2/V3 (`deepseek2`, also Kimi K2 and GLM-4.7-Flash): multi-head latent attention. Each token's key
    and values come from one row: `attn_kv_a_mqa` gives a latent of `kv_lora_rank` values (normalized by
    `attn_kv_a_norm`) and `rope.dimension_count` rotary key dims shared by every head; queries come from `attn_q`
    or through `attn_q_a`/`attn_q_a_norm`/`attn_q_b` (`attention.q_lora_rank`). `attention.key_length_mla` (nope +
    rope dims of a head) and `attention.value_length_mla` name the heads' sizes after `attn_k_b`/`attn_v_b` (older
    files: `key_length`/`value_length` and one `attn_kv_b`). Rotary pairs are interleaved (llama.cpp's NORM type);
    YaRN's `yarn_log_multiplier` (0.1 x mscale_all_dim) scales the softmax by its mscale squared, as llama.cpp."""
    arch = config.architecture
    if opt("attention.temperature_scale"):
        raise ValueError(f"{path}: '{arch}.attention.temperature_scale' (Mistral Large 3's attention temperature "
                         f"tuning) is not supported")
    config.kv_lora_rank = int(get("attention.kv_lora_rank"))
    config.q_lora_rank = int(opt("attention.q_lora_rank") or 0)
    mla_keys = opt("attention.key_length_mla") is not None
    qk_head = int(opt("attention.key_length_mla") if mla_keys else get("attention.key_length"))
    config.v_head_dim = int(opt("attention.value_length_mla") if mla_keys else get("attention.value_length"))
    config.qk_nope_dim = qk_head - config.rotary_dim
    if config.qk_nope_dim < 1:
        raise ValueError(f"{path}: '{arch}.rope.dimension_count' = {config.rotary_dim} leaves no key dims without "
                         f"rotary in heads of {qk_head}")
    config.head_dim, config.num_kv_heads = config.rotary_dim + config.kv_lora_rank, 1
    config.rope_interleaved = True
    mscale = 1.0
    if config.rope_yarn:  # llama.cpp's deepseek2 graph: cos and sin times attn_factor alone; the softmax scale
        # times (1 + 0.1 mscale_all_dim ln factor)^2
        log_mul = float(opt("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
        config.rope_attn_factor /= 1.0 + 0.1 * math.log(config.rope_scale)
        mscale = config.rope_attn_factor * (1.0 + 0.1 * math.log(config.rope_scale)) * (
            1.0 + 0.1 * log_mul * math.log(config.rope_scale))
    config.attention_scale = mscale * mscale / math.sqrt(qk_head)


def _qwen35(config: ModelConfig, get, opt, path: str) -> None:
    """Qwen3.5 (`qwen35`): gated delta-net layers (`attention.recurrent_layers`, else every layer but each
    `full_attention_interval`-th) beside full-attention layers whose queries carry a sigmoid gate (each head's rows
    in `attn_q` are its query then its gate) and q/k norms; partial multi-axis rotary (`rope.dimension_sections`:
    a text token has the same position on every axis, so the sections rotate as one plain partial rotary; an image's
    tokens (its qwen3vl_merger mmproj, without deepstack) turn them interleaved, as Qwen3-VL's); the
    pre-MLP norm in post_attention_norm; a next-token-prediction layer (`nextn_predict_layers`) is left out. A
    delta-net layer: `attn_qkv` gives q | k | v (`ssm.group_count` key heads of `ssm.state_size` dims,
    `ssm.time_step_rank` value heads in `ssm.inner_size` values; the converter orders the value heads so value
    head h reads key head h mod the key heads), a causal convolution over them (`ssm_conv1d`, `ssm.conv_kernel`
    wide) then SiLU, the delta rule with decay `ssm_a * softplus(alpha + ssm_dt)` and rate `sigmoid(beta)`, a
    per-head RMSNorm (`ssm_norm`) times `silu(attn_gate x)`, and `ssm_out`. Qwen3.5-MoE (`qwen35moe`) routes every
    layer's MLP: the top k of the softmax, renormalized, plus a shared expert times sigmoid(x . ffn_gate_inp_shexp)
    (qwen2moe's)."""
    arch = config.architecture
    recurrent = opt("attention.recurrent_layers")
    if recurrent is None:
        interval = int(opt("full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(config.num_layers)]
    if len(recurrent) < config.num_layers:
        raise ValueError(f"{path}: '{arch}.attention.recurrent_layers' has {len(recurrent)} entries for "
                         f"{config.num_layers} layers")
    config.delta_layers = tuple(bool(r) for r in recurrent[: config.num_layers])
    config.conv_kernel = int(get("ssm.conv_kernel"))
    config.ssm_state_size = int(get("ssm.state_size"))
    config.ssm_groups = int(get("ssm.group_count"))
    config.ssm_heads = int(get("ssm.time_step_rank"))
    config.ssm_inner_size = int(get("ssm.inner_size"))
    if (config.conv_kernel < 2 or config.ssm_groups < 1 or config.ssm_heads % config.ssm_groups
            or config.ssm_inner_size % config.ssm_heads):
        raise ValueError(f"{path}: '{arch}.ssm.*' = conv kernel {config.conv_kernel}, {config.ssm_groups} key heads, "
                         f"{config.ssm_heads} value heads, inner size {config.ssm_inner_size}: the key heads must "
                         f"divide the value heads, the value heads the inner size, and the kernel be at least 2")
    config.attn_output_gate = True
    config.ffn_norm_tensor = "post_attention_norm"
    _qwen2vl(config, get, opt, path)  # an image's tokens: interleaved M-RoPE positions, as Qwen3-VL's
    config.mrope_interleaved = True


def _gemma4(config: ModelConfig, get, opt, path: str) -> None:
    """Gemma 4 (`gemma4`), as llama.cpp's converter writes it: `attention.sliding_window_pattern` one flag a layer;
    full layers with heads of `attention.key_length` and their `attention.head_count_kv` entry, rotating
    `rope.dimension_count` dims at `rope.freq_base` with the `rope_freqs` factors (proportional rotary: the factors
    of the unrotated pairs are 1e30), sliding layers with `attention.key_length_swa`, `rope.dimension_count_swa` and
    `rope.freq_base_swa`; q/k norms, values RMS-normalized without weight, q.k unscaled (1.0); a full layer without
    `attn_v` uses its k projection for the values. The last `attention.shared_kv_layers` layers reuse the last
    earlier K/V of their kind. Per-layer embeddings (`embedding_length_per_layer_input` wide, `per_layer_*`
    tensors), a scalar a layer (`layer_output_scale`), GeGLU, the embedding times sqrt(hidden), final soft-capping;
    the MLP sizes come from the tensors (`feed_forward_length` per layer: the shared layers' double-wide MLP). A MoE
    layer runs the dense MLP and the routed experts side by side (`Decoder._gemma4_moe`)."""
    arch, n = config.architecture, config.num_layers
    config.embedding_scale = math.sqrt(config.hidden_size)
    config.post_norms = True
    config.activation = "gelu_tanh"
    config.expert_activation = "gelu_tanh"
    config.qk_norm = True
    config.value_norm = True
    config.attention_scale = 1.0
    config.sliding_window = int(get("attention.sliding_window"))
    config.swa_layers = _layer_pattern(n, get("attention.sliding_window_pattern"), f"{arch}.attention.sliding_window_pattern")
    counts = opt("attention.head_count_kv")
    if isinstance(counts, list):
        if len(counts) != n:
            raise ValueError(f"{path}: '{arch}.attention.head_count_kv' has {len(counts)} entries for {n} layers")
        full = {int(c) for c, s in zip(counts, config.swa_layers) if not s}
        swa = {int(c) for c, s in zip(counts, config.swa_layers) if s}
        if len(full) > 1 or len(swa) > 1:
            raise ValueError(f"{path}: '{arch}.attention.head_count_kv' = {counts}: the full layers' counts differ, or "
                             f"the sliding layers'")
        config.num_kv_heads = full.pop() if full else config.num_kv_heads
        config.num_kv_heads_swa = swa.pop() if swa else 0
    config.head_dim_swa = int(get("attention.key_length_swa"))
    if int(opt("attention.value_length_swa") or config.head_dim_swa) != config.head_dim_swa or \
            int(opt("attention.value_length") or config.head_dim) != config.head_dim:
        raise ValueError(f"{path}: '{arch}.attention.value_length(_swa)' differs from the key length (llama.cpp "
                         f"requires them equal)")
    config.rotary_dim_swa = int(opt("rope.dimension_count_swa") or config.head_dim_swa)
    config.rope_base_swa = float(opt("rope.freq_base_swa", 10000.0))
    config.rope_scale_swa = 1.0
    if config.rotary_dim_swa > config.head_dim_swa or config.rotary_dim_swa % 2:
        raise ValueError(f"{path}: '{arch}.rope.dimension_count_swa' = {config.rotary_dim_swa} must be even and at "
                         f"most the sliding head dim {config.head_dim_swa}")
    config.kv_shared_layers = int(opt("attention.shared_kv_layers") or 0)
    if not 0 <= config.kv_shared_layers < n:
        raise ValueError(f"{path}: '{arch}.attention.shared_kv_layers' = {config.kv_shared_layers} must leave some "
                         f"of the {n} layers with K/V of their own")
    for i in range(n - config.kv_shared_layers, n):
        config.kv_source(i)  # each shared layer's kind has a layer to read (raises otherwise)
    config.per_layer_input_size = int(opt("embedding_length_per_layer_input") or 0)
    config.final_softcap = float(opt("final_logit_softcapping", 0.0) or 0.0)


_FAMILIES = {
    "phi3": _phi3, "granite": _granite, "gemma2": _gemma2, "gemma3": _gemma3, "gpt-oss": _gpt_oss, "smollm3": _smollm3,
    "glm4moe": _glm4moe, "deepseek2": _deepseek2, "lfm2": _lfm2, "lfm2moe": _lfm2, "qwen35": _qwen35,
    "qwen35moe": _qwen35, "granitehybrid": _granitehybrid, "qwen2vl": _qwen2vl, "gemma4": _gemma4,
    "qwen3vl": _qwen3vl, "qwen3vlmoe": _qwen3vl,
}
