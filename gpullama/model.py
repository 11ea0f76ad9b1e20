"""The decoder: one forward over a ragged batch, for llama (and Mixtral) / mistral / qwen2 / qwen3 / phi3 /
granite / gemma2 / gemma3 / qwen2moe / qwen3moe / gpt-oss / smollm3 / glm4moe / deepseek2 / lfm2 / qwen35 /
granitehybrid / gemma4 through config flags."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpullama.config import ModelConfig
from gpullama.distributed import TensorParallel
from gpullama.ops import BatchMetadata, TorchOps
from gpullama.ops.experts import Experts
from gpullama.ops.rope import YarnParams, rope_cos_sin
from gpullama.quants import QTensor
from gpullama.sharding import ShardPlan

log = logging.getLogger("gpullama")


@dataclass
class LayerWeights:
    """Prepared weights of one decoder layer (fused q|k|v and gate|up where their types agree)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: list  # one fused weight, or [q, k, v] (+ the query gate: qwen35); [] in an MLA or recurrent layer
    qkv_bias: torch.Tensor | None
    o: object  # None in a recurrent layer
    gate_up: list | None  # one fused weight, or [gate, up] (None in a MoE layer)
    down: object | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # gemma: norm of the attention output before the residual add
    post_ffn_norm: torch.Tensor | None = None  # gemma: norm of the MLP output before the residual add
    window: int = 0  # sliding window of this layer (0: full attention)
    rope: int = 0  # index of this layer's rope table in `Decoder.rope_tables`
    o_bias: torch.Tensor | None = None  # gpt-oss
    sinks: torch.Tensor | None = None  # gpt-oss: [Hq] attention sink logits
    moe: MoeWeights | None = None  # a MoE layer's router and experts (gate_up and down are then None)
    mla: MlaWeights | None = None  # multi-head latent attention (DeepSeek) in place of q|k|v
    conv: ConvWeights | None = None  # a short convolution (LFM2) in place of attention
    delta: DeltaNetWeights | None = None  # a gated delta-net (Qwen3.5) in place of attention
    mamba: MambaWeights | None = None  # a Mamba2 layer (Granite 4.0) in place of attention
    cache: int = 0  # this layer's KV pool in k_caches / v_caches, or (a recurrent layer) its first state in `states`
    head_dim: int = 0  # this layer's head dims (Gemma 4's sliding and full layers differ)
    kv_heads: int = 0  # this layer's KV heads (of this rank)
    kv_shared: bool = False  # Gemma 4: no K/V of its own (qkv is [q]); it attends over the pool of `cache`
    v_norm: torch.Tensor | None = None  # Gemma 4: ones [D], the weightless RMSNorm of each value head
    per_layer: PerLayerWeights | None = None  # Gemma 4's per-layer embedding input
    out_scale: float = 1.0  # Gemma 4: the layer's output (the whole residual stream) times it


@dataclass
class PerLayerWeights:
    """A Gemma 4 layer's per-layer input: ``stream += norm(proj(gelu_tanh(inp_gate stream) * e))`` where e is the
    token's per-layer embedding for this layer (`Decoder._per_layer_inputs`)."""

    inp_gate: object  # [P, H]
    proj: object  # [H, P]
    post_norm: torch.Tensor  # [H]


@dataclass
class DeltaNetWeights:
    """A gated delta-net layer (Qwen3.5): x gives q | k | v (the convolution's channels), the output gate z and
    each value head's beta and alpha; q | k | v go through a causal depthwise convolution (its state: the last
    L - 1 inputs) and SiLU, then the gated delta rule (`ops.gated_delta_rule`: decay ``exp(decay * softplus(alpha
    + dt_bias))``, rate ``sigmoid(beta)``), a per-head RMSNorm times ``silu(z)``, and `out`."""

    in_proj: list  # x -> q | k | v | z | beta | alpha: one fused weight, or the file's four
    kernel: torch.Tensor  # [L, C] float32 taps of the convolution (as `ConvWeights.kernel`)
    decay: torch.Tensor  # [Hv] float32: ssm_a, -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] float32
    norm: torch.Tensor  # [Dv] float32
    out: object  # [H, Hv x Dv]


@dataclass
class MambaWeights:
    """A Mamba2 layer (Granite 4.0): ``in_proj x`` = z | x B C | dt; x B C through a causal depthwise convolution
    (plus its bias; its state: the last L - 1 inputs) and SiLU; the selective scan (`ops.ssm_scan`: per head, decay
    ``exp(softplus(dt + dt_bias) a)``, input ``softplus(..) x B``, output C . state) plus ``d x``; ``y silu(z)``
    through an RMSNorm per group and `out`."""

    in_proj: object  # [inner + conv channels + heads, H]
    kernel: torch.Tensor  # [L, C] float32 taps of the convolution (as `ConvWeights.kernel`)
    conv_bias: torch.Tensor  # [C] float32
    dt_bias: torch.Tensor  # [heads] float32
    a: torch.Tensor  # [heads] float32: ssm_a, -exp(A_log)
    d: torch.Tensor  # [heads] float32: the skip's weight
    norm: torch.Tensor  # [groups, inner / groups] float32
    out: object  # [H, inner]


@dataclass
class ConvWeights:
    """A short-convolution layer (LFM2): ``in_proj x`` = B | C | x', then ``C * conv(B * x')`` through
    ``out_proj``; the convolution is causal and per channel, over the last `kernel`'s width of tokens."""

    in_proj: object  # [3H, H]
    kernel: torch.Tensor  # [L, H] float32: channel c's output at t is sum_j kernel[j, c] * input[t - L + 1 + j, c]
    out_proj: object  # [H, H]


@dataclass
class MlaWeights:
    """A multi-head latent attention layer (DeepSeek-V2/V3). The hidden state x gives the queries (``attn_q``, or
    ``attn_q_b(norm(attn_q_a x))``) and one row a token, ``attn_kv_a_mqa x`` = latent (normalized) | rotary key
    part; the pool keeps ``rotary | latent`` of each token. Each head's no-rotary query dims are absorbed into the
    latent's space (``attn_k_b``), so attention is one query row of ``rotary + kv_lora_rank`` dims a head over the
    pool's rows, its output the weighted latents, which ``attn_v_b`` turns into the head's values."""

    x_a: list  # x -> [queries (q_lora_rank, or Hq x (nope + rope) without the bottleneck) | latent | rotary]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]; None without the bottleneck
    q_b: object | None  # [Hq x (nope + rope), q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    k_b: torch.Tensor  # [Hq, kv_lora_rank, nope]: a head's no-rotary query dims -> its query in the latent space
    v_b: torch.Tensor  # [Hq, v_head_dim, kv_lora_rank]: a head's weighted latent -> its values


@dataclass
class MoeWeights:
    """A MoE layer: the router, the routed experts and a shared expert (qwen2moe's sigmoid-gated; GLM-4.5's and
    DeepSeek's always on)."""

    router: object  # [E, H]
    router_bias: torch.Tensor | None  # [E] (gpt-oss)
    experts: Experts
    choice_bias: torch.Tensor | None = None  # [E] exp_probs_b: added to the probabilities to choose (GLM-4.5)
    shared_gate_up: list | None = None  # the shared expert's gate|up (fused, or [gate, up])
    shared_down: object | None = None
    shared_gate: torch.Tensor | None = None  # [H]: the shared expert's output is scaled by sigmoid(x . shared_gate)
    # Gemma 4: the experts beside the layer's dense MLP (`Decoder._gemma4_moe`)
    expert_scale: torch.Tensor | None = None  # [E] ffn_down_exps.scale: a chosen expert's weight times its scale
    router_norm: torch.Tensor | None = None  # [H] ffn_gate_inp.scale / sqrt(H): the router reads norm(stream) * it
    input_norm: torch.Tensor | None = None  # [H] pre_ffw_norm_2: the experts' input norm of the stream
    dense_post_norm: torch.Tensor | None = None  # [H] post_ffw_norm_1: the dense MLP's output norm
    experts_post_norm: torch.Tensor | None = None  # [H] post_ffw_norm_2: the experts' output norm


@dataclass
class RankHead:
    """A reranker's classification head over its pooled hidden state (llama.cpp's `build_pooling`, pooling rank):
    ``cls`` (+ bias) then tanh where the file has one, ``cls.output`` (+ bias), then a softmax where the family says
    (`ModelConfig.rank_softmax`); float32 on the CPU (a few rows)."""

    out: torch.Tensor  # cls.output.weight [labels, H']
    out_bias: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # cls.weight [H', H]
    dense_bias: torch.Tensor | None = None
    softmax: bool = False

    @classmethod
    def from_tensors(cls, tensors: dict[str, QTensor], softmax: bool) -> RankHead | None:
        """The head the file holds (whole, never sharded: it runs on rank 0's pooled rows), or None."""
        def dense(name: str) -> torch.Tensor | None:
            t = tensors.get(name)
            return None if t is None else t.dequantize(torch.float32).cpu()

        out = dense("cls.output.weight")
        if out is None:
            return None
        return cls(out, dense("cls.output.bias"), dense("cls.weight"), dense("cls.bias"), softmax)

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head's outputs for one pooled hidden state ``[H]`` (the first is the reranker's score)."""
        x = pooled.float().cpu()
        if self.dense is not None:
            x = self.dense @ x
            x = torch.tanh(x + self.dense_bias if self.dense_bias is not None else x)
        x = self.out @ x
        if self.out_bias is not None:
            x = x + self.out_bias
        return torch.softmax(x, dim=0) if self.softmax else x


def unpermute_qk_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (it interleaves the two rotary halves of each head)."""
    head_dim = rows // num_heads
    half = head_dim // 2
    head = torch.arange(num_heads)[:, None, None]
    side = torch.arange(2)[None, :, None]
    pair = torch.arange(half)[None, None, :]
    # original row head*D + side*half + pair was written at head*D + 2*pair + side
    return (head * head_dim + 2 * pair + side).reshape(-1)


class Decoder:
    """Weights prepared for one ops backend, and the forward pass of one engine step.

    Under tensor parallelism (`tp` of more than one rank) it holds this rank's shard of each weight (see
    `gpullama.sharding`) and runs the forward over its heads and MLP rows, summing with `tp.all_reduce` after o,
    down and the embedding and gathering the logits to rank 0; with one rank those calls return their input."""

    def __init__(
        self, config: ModelConfig, tensors: dict[str, QTensor], ops: TorchOps, max_positions: int,
        tp: TensorParallel | None = None,
    ):
        self.config = config
        self.ops = ops
        self.tp = tp or TensorParallel()
        plan = ShardPlan(config, self.tp.rank, self.tp.world_size)
        plan.check(tensors)
        # this rank's heads (all of them with one rank): the q/k/v widths and the KV pool's heads
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        device = ops.device

        def get(name: str) -> QTensor:
            if name not in tensors:
                raise ValueError(f"{config.architecture} model file has no tensor {name!r}")
            return plan.local(name, tensors[name])

        def dense(name: str) -> torch.Tensor:
            return get(name).dequantize(torch.float32).to(device)

        def qk(name: str, heads: int) -> QTensor:
            t = get(name)
            return t.take_rows(unpermute_qk_rows(t.shape[0], heads)) if config.permuted_qk else t

        def qk_bias(name: str, heads: int) -> torch.Tensor:
            b = dense(name)
            return b[unpermute_qk_rows(b.shape[0], heads).to(device)] if config.permuted_qk else b

        fused = ops.prepare_joined  # matrices that read one input, as one weight where they can be

        c = config
        self._tensors = tensors
        # every base tensor's shape, for checking LoRA adapters (`gpullama.lora.prepare_lora`)
        self.tensor_shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        # loaded LoRA adapters by id (`gpullama.lora.Adapter`); a step's rows name theirs in `BatchMetadata.lora`
        self.adapters: dict[int, object] = {}
        self.rope_tables, table_of_layer = self._rope_tables(tensors, max_positions, device)
        self.layers: list[LayerWeights] = []
        kv_layers = c.kv_layers
        # each recurrent layer's states in the flat `states` list (`new_states`): from this index on
        state_start = [sum(len(c.state_shapes(j)) for j in range(i)) for i in range(c.num_layers)]
        for i in range(c.num_layers):
            p = f"blk.{i}."
            mla = self._mla_weights(p, get, dense, fused) if c.is_mla else None
            conv = ConvWeights(ops.prepare_weight(get(p + "shortconv.in_proj.weight")), dense(
                p + "shortconv.conv.weight").t().contiguous(), ops.prepare_weight(get(p + "shortconv.out_proj.weight"))) \
                if c.is_conv(i) else None
            delta = DeltaNetWeights(
                fused([get(p + n + ".weight") for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")]),
                dense(p + "ssm_conv1d.weight").t().contiguous(), dense(p + "ssm_a").reshape(-1),
                dense(p + "ssm_dt.bias").reshape(-1), dense(p + "ssm_norm.weight").reshape(-1),
                ops.prepare_weight(get(p + "ssm_out.weight"))) if c.is_delta(i) else None
            mamba = self._mamba_weights(p, get, dense) if c.is_mamba(i) else None
            recurrent = conv is not None or delta is not None or mamba is not None
            fused_qkv = p + "attn_qkv.weight" in tensors and not recurrent
            extra = []  # parts after v in the fused q|k|v matrix: qwen35's query gates
            if mla is not None or recurrent:
                pass
            elif c.attn_output_gate:  # each head's rows are its query then its gate: gather each kind together
                q_gate = get(p + "attn_q.weight")
                rows = torch.arange(q_gate.shape[0]).view(self.num_heads, 2, c.head_dim)
                q, extra = q_gate.take_rows(rows[:, 0].reshape(-1)), [q_gate.take_rows(rows[:, 1].reshape(-1))]
                k = qk(p + "attn_k.weight", self.num_kv_heads)
            elif not fused_qkv:
                q = qk(p + "attn_q.weight", self.num_heads)
                k = qk(p + "attn_k.weight", self.num_kv_heads) if c.kv_source(i) == i else None
            kv_shared = not recurrent and mla is None and c.kv_source(i) != i
            # a Gemma 4 full layer without attn_v: its keys' projection doubles as its values'
            v_name = p + ("attn_v.weight" if p + "attn_v.weight" in tensors or not c.value_norm else "attn_k.weight")
            bias = None
            if c.attention_bias:
                bias = torch.cat(
                    [
                        qk_bias(p + "attn_q.bias", self.num_heads),
                        qk_bias(p + "attn_k.bias", self.num_kv_heads),
                        dense(p + "attn_v.bias"),
                    ]
                )
            moe = self._moe_weights(p, get, dense, fused) if p + "ffn_gate_inp.weight" in tensors else None
            gate_up_fused = p + "ffn_gate.weight" not in tensors  # phi3: ffn_up holds gate then up, 2 I rows
            dense_mlp = moe is None or moe.input_norm is not None  # Gemma 4's MoE layers keep their dense MLP
            self.layers.append(
                LayerWeights(
                    attn_norm=dense(p + "attn_norm.weight"),
                    ffn_norm=dense(p + c.ffn_norm_tensor + ".weight"),
                    qkv=[] if mla is not None or recurrent else [ops.prepare_weight(get(
                        p + "attn_qkv.weight"))] if fused_qkv else [ops.prepare_weight(q)] if kv_shared else
                    fused([q, k, get(v_name), *extra]),
                    qkv_bias=bias,
                    o=None if recurrent else ops.prepare_weight(get(p + "attn_output.weight")),
                    gate_up=None if not dense_mlp else [ops.prepare_weight(get(p + "ffn_up.weight"))]
                    if gate_up_fused else fused([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")]),
                    down=None if not dense_mlp else ops.prepare_weight(get(p + "ffn_down.weight")),
                    q_norm=dense(p + "attn_q_norm.weight") if c.qk_norm and not recurrent else None,
                    k_norm=dense(p + "attn_k_norm.weight") if c.qk_norm and not recurrent and not kv_shared else None,
                    post_attn_norm=dense(p + "post_attention_norm.weight") if c.post_norms else None,
                    post_ffn_norm=dense(p + "post_ffw_norm.weight") if c.post_norms else None,
                    window=c.sliding_window if c.is_sliding(i) else 0,
                    rope=table_of_layer[i],
                    o_bias=dense(p + "attn_output.bias") if c.attn_output_bias else None,
                    sinks=dense(p + "attn_sinks.weight").reshape(-1) if c.attn_sinks else None,
                    moe=moe,
                    mla=mla,
                    conv=conv,
                    delta=delta,
                    mamba=mamba,
                    cache=state_start[i] if recurrent else kv_layers.index(c.kv_source(i)),
                    head_dim=c.layer_head_dim(i),
                    kv_heads=self.num_kv_heads * c.layer_kv_heads(i) // c.num_kv_heads,
                    kv_shared=kv_shared,
                    v_norm=torch.ones(c.layer_head_dim(i), device=device) if c.value_norm and not recurrent else None,
                    per_layer=PerLayerWeights(ops.prepare_weight(get(p + "inp_gate.weight")), ops.prepare_weight(
                        get(p + "proj.weight")), dense(p + "post_norm.weight")) if c.per_layer_input_size else None,
                    out_scale=float(dense(p + "layer_output_scale.weight").reshape(-1)[0])
                    if p + "layer_output_scale.weight" in tensors else 1.0,
                )
            )
        embedding = get("token_embd.weight")
        self.embedding = ops.prepare_embedding(embedding)
        # Gemma 4's per-layer embeddings: a second table (P values a layer, a row a token), and the projection of the
        # embeddings joined to it (`_per_layer_inputs`)
        self.per_layer_embedding = self.per_layer_proj = self.per_layer_proj_norm = None
        if c.per_layer_input_size:
            self.per_layer_embedding = ops.prepare_embedding(get("per_layer_token_embd.weight"))
            self.per_layer_proj = ops.prepare_weight(get("per_layer_model_proj.weight"))
            self.per_layer_proj_norm = dense("per_layer_proj_norm.weight")
        self.output_norm = dense(c.output_norm_tensor + ".weight")
        head_name = "token_embd.weight" if c.tied_embeddings else "output.weight"
        self.output = ops.prepare_weight(get(head_name))
        # this rank's vocabulary slice (all of it with one rank) and the real vocabulary the gathered logits keep
        self.vocab_size = tensors[head_name].shape[0]
        self.vocab_start = plan.vocab_start(tensors["token_embd.weight"].shape[0])
        self.vocab_rows = embedding.shape[0]
        self.scale = c.attention_scale or c.head_dim**-0.5
        # a reranker's classification head (None for other models), applied to its pooled last hidden state
        self.rank_head = RankHead.from_tensors(tensors, c.rank_softmax)
        del self._tensors
        # the backend's one-call form of the layer loop (`ops.layer_stack`), built for the first pool it sees; off:
        # the loop below, one op at a time
        self.native_stack = True
        self._stack: tuple[tuple, object] | None = None

    def _mla_weights(self, p: str, get, dense, fused) -> MlaWeights:
        """Layer `p`'s latent attention weights, as llama.cpp's converter writes them (``attn_k_b``/``attn_v_b``, or
        one ``attn_kv_b`` in older files); the interleaved rotary rows of q and of the rotary key part reordered to
        halves (a row gather on the stored blocks, the same for q and k, so every score is unchanged)."""
        c, ops, tensors = self.config, self.ops, self._tensors
        r, nope, lora, hq = c.rotary_dim, c.qk_nope_dim, c.kv_lora_rank, self.num_heads
        halves = unpermute_qk_rows(r, 1)
        q_rows = torch.cat([h * (nope + r) + torch.cat((torch.arange(nope), nope + halves)) for h in range(hq)])
        kv_rows = torch.cat((torch.arange(lora), lora + halves))
        kv_a = get(p + "attn_kv_a_mqa.weight").take_rows(kv_rows)
        bottleneck = c.q_lora_rank > 0
        q = get(p + "attn_q_b.weight").take_rows(q_rows) if bottleneck else get(p + "attn_q.weight").take_rows(q_rows)
        if p + "attn_k_b.weight" in tensors:
            k_b, v_b = dense(p + "attn_k_b.weight"), dense(p + "attn_v_b.weight")
        else:  # older files: attn_kv_b [Hq x (nope + v), kv_lora_rank], each head's k rows then its v rows
            kv_b = dense(p + "attn_kv_b.weight").view(hq, nope + c.v_head_dim, lora)
            k_b, v_b = kv_b[:, :nope].transpose(1, 2), kv_b[:, nope:]
        if tuple(k_b.shape) != (hq, lora, nope) or tuple(v_b.shape) != (hq, c.v_head_dim, lora):
            raise ValueError(f"{p}attn_k_b/attn_v_b have shapes {tuple(k_b.shape)}, {tuple(v_b.shape)}; the heads' "
                             f"sizes make {(hq, lora, nope)}, {(hq, c.v_head_dim, lora)}")
        return MlaWeights(
            x_a=fused([get(p + "attn_q_a.weight"), kv_a] if bottleneck else [q, kv_a]),
            q_a_norm=dense(p + "attn_q_a_norm.weight") if bottleneck else None,
            q_b=ops.prepare_weight(q) if bottleneck else None,
            kv_a_norm=dense(p + "attn_kv_a_norm.weight"),
            k_b=ops.prepare_head_weights(k_b), v_b=ops.prepare_head_weights(v_b),
        )

    def _mamba_weights(self, p: str, get, dense) -> MambaWeights:
        """Layer `p`'s Mamba2 weights as llama.cpp's converter writes them (``ssm_in``, ``ssm_conv1d`` [C, L] with
        its bias, ``ssm_dt.bias``, ``ssm_a`` and ``ssm_d`` [heads, 1], ``ssm_norm`` [groups, inner / groups],
        ``ssm_out``)."""
        c, ops = self.config, self.ops
        channels, heads = c.delta_conv_channels, c.ssm_heads
        kernel = dense(p + "ssm_conv1d.weight")
        if tuple(kernel.shape) != (channels, c.conv_kernel):
            raise ValueError(f"{p}ssm_conv1d.weight has shape {tuple(kernel.shape)}; the ssm.* keys make "
                             f"{(channels, c.conv_kernel)}")
        bias = dense(p + "ssm_conv1d.bias").reshape(-1) if p + "ssm_conv1d.bias" in self._tensors else \
            torch.zeros(channels, device=kernel.device)
        return MambaWeights(
            in_proj=ops.prepare_weight(get(p + "ssm_in.weight")), kernel=kernel.t().contiguous(), conv_bias=bias,
            dt_bias=dense(p + "ssm_dt.bias").reshape(heads), a=dense(p + "ssm_a").reshape(heads),
            d=dense(p + "ssm_d").reshape(heads), norm=dense(p + "ssm_norm.weight").reshape(c.ssm_groups, -1),
            out=ops.prepare_weight(get(p + "ssm_out.weight")),
        )

    def _moe_weights(self, p: str, get, dense, fused) -> MoeWeights:
        """Layer `p`'s router, experts (``ffn_{gate,up,down}_exps``, or a fused ``ffn_gate_up_exps``, with their
        biases) and shared expert (``ffn_*_shexp``), as llama.cpp's converter names them."""
        c, ops, tensors = self.config, self.ops, self._tensors

        def bias(name: str) -> torch.Tensor | None:
            return dense(p + name) if p + name in tensors else None

        if p + "ffn_gate_up_exps.weight" in tensors:
            gate_up = [get(p + "ffn_gate_up_exps.weight")]
            gate_up_bias = bias("ffn_gate_up_exps.bias")
        else:
            gate_up = [get(p + "ffn_gate_exps.weight"), get(p + "ffn_up_exps.weight")]
            parts = [bias("ffn_gate_exps.bias"), bias("ffn_up_exps.bias")]
            gate_up_bias = torch.cat(parts, dim=-1) if parts[0] is not None and parts[1] is not None else None
        down = get(p + "ffn_down_exps.weight")
        for t in (*gate_up, down):
            if len(t.shape) != 3 or t.shape[0] != c.num_experts:
                raise ValueError(f"tensor {t.name!r} has shape {t.shape}; expected {c.num_experts} stacked experts")
        experts = ops.prepare_experts(gate_up, down, gate_up_bias, bias("ffn_down_exps.bias"), c.expert_activation,
                                      c.swiglu_alpha, c.swiglu_limit)
        moe = MoeWeights(ops.prepare_weight(get(p + "ffn_gate_inp.weight")), bias("ffn_gate_inp.bias"), experts,
                         bias("exp_probs_b.bias"))
        if p + "ffn_gate_inp.scale" in tensors:  # Gemma 4: the router's scale, norms around the experts
            moe.router_norm = dense(p + "ffn_gate_inp.scale").reshape(-1) / c.hidden_size**0.5
            moe.expert_scale = dense(p + "ffn_down_exps.scale").reshape(-1) if p + "ffn_down_exps.scale" in tensors \
                else None
            moe.input_norm, moe.dense_post_norm, moe.experts_post_norm = (
                dense(p + n + ".weight") for n in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"))
        if p + "ffn_down_shexp.weight" in tensors:
            moe.shared_gate_up = fused([get(p + "ffn_gate_shexp.weight"), get(p + "ffn_up_shexp.weight")])
            moe.shared_down = ops.prepare_weight(get(p + "ffn_down_shexp.weight"))
            if p + "ffn_gate_inp_shexp.weight" in tensors:
                moe.shared_gate = dense(p + "ffn_gate_inp_shexp.weight").reshape(-1)
        return moe

    @property
    def cos_sin(self) -> torch.Tensor:
        """The rope table of the full-attention layers (the one `ops.prepare_step` derives each step's rows of)."""
        return self.rope_tables[0]

    def _rope_tables(
        self, tensors: dict[str, QTensor], max_positions: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[int]]:
        """The cos|sin tables (one, a second for sliding layers with their own rope base or scale: Gemma 3, and the
        identity for NoPE layers: SmolLM3) and each layer's table. Frequency factors: Llama 3's ``rope_freqs``, or Phi-3's LongRoPE ``rope_factors_long``
        (when the context is longer than the original one, as llama.cpp picks them) / ``rope_factors_short``."""
        c = self.config
        factors = None
        if "rope_freqs.weight" in tensors:
            factors = tensors["rope_freqs.weight"]
        elif "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
            if not c.rope_original_context:
                raise ValueError(
                    f"{c.architecture} model has LongRoPE factors but no metadata key "
                    f"'{c.architecture}.rope.scaling.original_context_length'"
                )
            kind = "long" if max_positions > c.rope_original_context else "short"
            name = f"rope_factors_{kind}.weight"
            log.info("LongRoPE: %s factors for a context of %d tokens (original context %d)", kind, max_positions,
                     c.rope_original_context)
            if name not in tensors:
                raise ValueError(f"{c.architecture} model file has no tensor {name!r}")
            factors = tensors[name]
        if factors is not None:
            factors = factors.dequantize(torch.float32).reshape(-1)
            if factors.numel() != c.rotary_dim // 2:
                raise ValueError(
                    f"rope frequency factors have {factors.numel()} values, expected {c.rotary_dim // 2} "
                    f"(half the rotary dims)"
                )

        yarn = None
        if c.rope_yarn:
            yarn = YarnParams(c.rope_original_context, c.rope_yarn_beta_fast, c.rope_yarn_beta_slow,
                              c.rope_yarn_ext_factor, c.rope_yarn_truncate)

        def table(base: float, scale: float, dims: int = c.rotary_dim, factors=factors) -> torch.Tensor:
            return rope_cos_sin(dims, max_positions, base, factors, scale, c.rope_attn_factor, yarn).to(device)

        if c.nope_layers and all(c.is_nope(i) for i in c.kv_layers):  # no layer rotates (Granite 4.0-H): one
            # identity table two dims wide (a no-op on the first pair of each head), not the file's context
            # (2^20 positions) times the head dims
            return [torch.cat((torch.ones(max_positions, 1), torch.zeros(max_positions, 1)), dim=-1).to(device)], \
                [0] * c.num_layers
        tables = [table(c.rope_base, c.rope_scale)]
        of_layer = [0] * c.num_layers
        swa = (c.rope_base_swa or c.rope_base, c.rope_scale_swa)
        if c.swa_layers and (swa != (c.rope_base, c.rope_scale) or c.rotary_dim_swa):
            # Gemma 4's sliding layers rotate dims of their own, without the full layers' rope_freqs
            tables.append(table(*swa, c.rotary_dim_swa or c.rotary_dim, None if c.rotary_dim_swa else factors))
            of_layer = [1 if c.is_sliding(i) else 0 for i in range(c.num_layers)]
        if c.nope_layers:  # NoPE layers rotate by the identity (cos 1, sin 0): every backend's rotary leaves them be
            tables.append(torch.cat((torch.ones(max_positions, c.rotary_dim // 2),
                                     torch.zeros(max_positions, c.rotary_dim // 2)), dim=-1).to(device))
            of_layer = [len(tables) - 1 if c.is_nope(i) else t for i, t in enumerate(of_layer)]
        return tables, of_layer

    def _linear_parts(self, x: torch.Tensor, parts: list, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(parts) == 1:
            return self.ops.linear(x, parts[0], bias)
        out = torch.cat([self.ops.linear(x, w) for w in parts], dim=-1)
        return out + bias if bias is not None else out

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, meta: BatchMetadata, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
        states: list[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Run the batch's tokens through the decoder, writing their k/v into the pool (and a recurrent layer's
        states into its `states` tensors, at `meta.state_slots`); logits of `meta.logits_indices`."""
        return self.forward_pooled(token_ids, meta, k_caches, v_caches, states)[0]

    def new_states(self, num_slots: int) -> list[torch.Tensor]:
        """Zeroed per-sequence states of the recurrent layers, float32 ``[num_slots, *shape]`` for each shape of
        `ModelConfig.state_shapes`, layer by layer (a short convolution: its last inputs; a delta-net: its
        convolution's last inputs, then its state matrices); [] for a model without such layers."""
        c = self.config
        return [torch.zeros(num_slots, *shape, device=self.ops.device)
                for i in range(c.num_layers) for shape in c.state_shapes(i)]

    @torch.inference_mode()
    def forward_pooled(
        self, token_ids: torch.Tensor, meta: BatchMetadata, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
        states: list[torch.Tensor] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the final hidden states (after the output norm) of `meta.pool_indices`, summed into
        `meta.num_pools` rows by `meta.pool_segments` (float32 ``[num_pools, H]``; None without such rows)."""
        c, ops, tp = self.config, self.ops, self.tp
        rs = c.residual_scale
        hidden = self._embed(token_ids)
        if meta.lora:  # before the images: their rows take the image's embeddings, not the token's
            self._lora_embedding(hidden, token_ids, meta)
        deepstack = None
        if meta.input_embeds is not None:  # image embeddings in place of their tokens' (no embedding scale)
            rows, values = meta.input_embeds
            hidden[rows] = values[:, : c.hidden_size].to(hidden.dtype)
            if c.deepstack_layers:  # Qwen3-VL: the rest of each row is added after the first layers
                deepstack = (rows, values[:, c.hidden_size :].reshape(rows.shape[0], c.deepstack_layers, -1)
                             .to(hidden.dtype))
        per_layer = self._per_layer_inputs(self._per_layer_ids(token_ids, meta), hidden) \
            if c.per_layer_input_size else None
        # the one-call stack attends causally only and reads one position a row: a step with an image that attends
        # both ways, with M-RoPE rows or with deepstack rows, runs the layer loop
        stack = self._layer_stack(k_caches, v_caches, states) if self.native_stack and meta.image_attention is None and \
            meta.rope_table is None and deepstack is None else None
        if stack is not None:
            hidden, residual = stack(hidden, meta)
        else:
            hidden, residual = self._layers(hidden, meta, k_caches, v_caches, states, per_layer, deepstack)
        rows = meta.logits_indices
        pooled = None
        if meta.pool_indices is not None:  # the embedding rows share the output norm with the sampling rows
            both = torch.cat([rows, meta.pool_indices])
            x, _ = ops.rms_norm(hidden[both], self.output_norm, c.rms_eps, residual[both], rs)
            states = x[rows.shape[0]:].float()
            pooled = torch.zeros(meta.num_pools, states.shape[1], dtype=torch.float32, device=states.device)
            pooled.index_add_(0, meta.pool_segments, states)
            x = x[: rows.shape[0]]
        else:
            x, _ = ops.rms_norm(hidden[rows], self.output_norm, c.rms_eps, residual[rows], rs)
        logits = ops.linear(x, self.output)
        if meta.lora:
            for g in meta.lora:
                if g.adapter.output is not None and g.out_rows.numel():
                    _add_pair(logits, x, g.adapter.output, g.out_rows, g.out_scales)
        if c.logit_scale != 1.0 or c.final_softcap:  # elementwise: the same on each rank's slice as on the whole
            logits = ops.soft_cap(logits, c.final_softcap, 1.0 / c.logit_scale)
        # rank 0 gets every rank's vocabulary slice, less the padding of the last one (one rank: `logits` itself)
        return tp.gather_last_dim(logits.float())[:, : self.vocab_size], pooled

    def _layers(
        self, hidden: torch.Tensor, meta: BatchMetadata, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
        states: list[torch.Tensor] = (), per_layer: torch.Tensor | None = None,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over the embeddings `hidden`, one op at a time: (the last layer's output, the residual
        stream before it); `per_layer`: Gemma 4's per-layer inputs ``[T, layers, P]``; `deepstack`: Qwen3-VL's
        image rows and what is added to their stream after each of the first layers, ``[rows, k, H]``."""
        c, ops, tp = self.config, self.ops, self.tp
        t = hidden.shape[0]
        rs = c.residual_scale
        act = ops.gelu_tanh_mul if c.activation == "gelu_tanh" else ops.silu_mul
        # rotary rows of each further rope table, once per step (the first one's come with `meta`)
        metas = [meta] + [ops.prepare_rope(meta, table) for table in self.rope_tables[1:]]
        residual = None
        lora = meta.lora
        for i, layer in enumerate(self.layers):
            x, residual = ops.rms_norm(hidden, layer.attn_norm, c.rms_eps, residual, rs)
            if layer.mla is not None or layer.conv is not None or layer.delta is not None or layer.mamba is not None:
                if layer.mla is not None:
                    hidden = self._latent_attention(x, layer, k_caches[layer.cache], metas[layer.rope])
                elif layer.conv is not None:
                    hidden = self._short_conv(x, layer.conv, states[layer.cache], meta)
                elif layer.mamba is not None:
                    hidden = self._mamba(x, layer.mamba, states[layer.cache], states[layer.cache + 1], meta)
                else:
                    hidden = self._delta_net(x, layer.delta, states[layer.cache], states[layer.cache + 1], meta)
                x, residual = ops.rms_norm(hidden, layer.ffn_norm, c.rms_eps, residual, rs)
                hidden = self._mlp(x, layer, act, lora and (lora, i))
                _add_deepstack(hidden, deepstack, i)
                continue
            d, hk = layer.head_dim, layer.kv_heads  # Gemma 4's sliding and full layers differ
            q_size, kv_size = self.num_heads * d, hk * d
            qkv = self._linear_parts(x, layer.qkv, layer.qkv_bias)
            if lora:
                _add_lora(qkv, x, lora, i, "qkv")
            q = qkv[:, :q_size].view(t, self.num_heads, d)
            if c.qk_norm:
                q = ops.head_rms_norm(q, layer.q_norm, c.rms_eps)
            table = self.rope_tables[layer.rope]
            k_cache, v_cache = k_caches[layer.cache], v_caches[layer.cache]
            if layer.kv_shared:  # Gemma 4: attends over an earlier layer's K/V, caches none
                q = ops.rope(q, table, metas[layer.rope])
            else:
                k = qkv[:, q_size : q_size + kv_size].view(t, hk, d)
                v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(t, hk, d)
                if c.qk_norm:
                    k = ops.head_rms_norm(k, layer.k_norm, c.rms_eps)
                if layer.v_norm is not None:
                    v = ops.head_rms_norm(v, layer.v_norm, c.rms_eps)
                q, k = ops.rope_and_cache(q, k, v, table, k_cache, v_cache, metas[layer.rope])
            attn = ops.attention(q, k_cache, v_cache, meta, self.scale, layer.window, c.attn_softcap, layer.sinks)
            if meta.image_attention is not None:  # an image's rows see the whole image (every row's k/v is written)
                rows, image_meta = meta.image_attention
                attn[rows] = ops.attention(q[rows], k_cache, v_cache, image_meta, self.scale, layer.window,
                                           c.attn_softcap, layer.sinks)
            attn = attn.reshape(t, q_size)
            if c.attn_output_gate:  # qwen35: each head's output times the sigmoid of its gate
                attn = attn * torch.sigmoid(qkv[:, q_size + 2 * kv_size :])
            hidden = ops.linear(attn, layer.o, layer.o_bias)
            if lora:
                _add_lora(hidden, attn, lora, i, "o")
            hidden = tp.all_reduce(hidden)
            if layer.post_attn_norm is not None:
                hidden = ops.post_norm(hidden, layer.post_attn_norm, c.rms_eps)
            x, residual = ops.rms_norm(hidden, layer.ffn_norm, c.rms_eps, residual, rs)
            if layer.moe is not None and layer.moe.input_norm is not None:
                hidden = self._gemma4_moe(x, residual, layer, act)
            else:
                hidden = self._mlp(x, layer, act, lora and (lora, i))
            if layer.per_layer is not None or layer.out_scale != 1.0:  # Gemma 4: on the whole stream
                hidden = self._gemma4_layer_end(hidden + residual, layer, per_layer[:, i] if layer.per_layer else None)
                residual = None
            _add_deepstack(hidden, deepstack, i)
        if residual is None:  # the last layer ended the stream itself
            residual = torch.zeros_like(hidden)
        return hidden, residual

    def _gemma4_layer_end(self, stream: torch.Tensor, layer: LayerWeights, inputs: torch.Tensor | None) -> torch.Tensor:
        """The end of a Gemma 4 layer on its residual stream ``[T, H]``: the per-layer input added (`inputs`: each
        token's ``[T, P]`` for this layer), then everything times the layer's scalar."""
        ops = self.ops
        if layer.per_layer is not None:
            w = layer.per_layer
            gated = ops.gelu_tanh_mul(torch.cat((ops.linear(stream, w.inp_gate), inputs), dim=-1))
            stream = stream + ops.post_norm(ops.linear(gated, w.proj), w.post_norm, self.config.rms_eps)
        return stream * layer.out_scale if layer.out_scale != 1.0 else stream

    def _gemma4_moe(self, x: torch.Tensor, stream: torch.Tensor, layer: LayerWeights, act) -> torch.Tensor:
        """A Gemma 4 MoE layer's feed-forward block: the dense MLP of the normalized `x` and the experts of the
        stream (normalized by their own norm; the router reads ``norm(stream) * scale / sqrt(H)``: softmax, top k,
        renormalized, each weight times its expert's scale), each post-normed, summed and post-normed, as llama.cpp's
        graph and transformers compute it."""
        c, ops, moe = self.config, self.ops, layer.moe
        mlp = ops.linear(act(self._linear_parts(x, layer.gate_up)), layer.down)
        mlp = ops.post_norm(mlp, moe.dense_post_norm, c.rms_eps)
        logits = ops.linear(ops.post_norm(stream, moe.router_norm, c.rms_eps), moe.router)
        ids, weights = ops.route(logits, c.num_experts_used, c.expert_gating, c.expert_weights_norm,
                                 c.expert_weights_scale)
        if moe.expert_scale is not None:
            weights = weights * moe.expert_scale[ids]
        experts = ops.moe(ops.post_norm(stream, moe.input_norm, c.rms_eps), ids, weights, moe.experts)
        return ops.post_norm(mlp + ops.post_norm(experts, moe.experts_post_norm, c.rms_eps), layer.post_ffn_norm,
                             c.rms_eps)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights, act, lora: tuple | None = None) -> torch.Tensor:
        """The MLP block of the normalized ``x [T, H]``: the experts or the dense MLP, all-reduced, post-normed;
        `lora`: (the step's LoRA groups, this layer's index) to add to the dense MLP's matrices."""
        c, ops, tp = self.config, self.ops, self.tp
        if layer.moe is not None:
            hidden = tp.all_reduce(self._moe(x, layer.moe))
        elif lora:
            gate_up = self._linear_parts(x, layer.gate_up)
            _add_lora(gate_up, x, *lora, "gate_up")
            y = act(gate_up)
            hidden = ops.linear(y, layer.down)
            _add_lora(hidden, y, *lora, "down")
            hidden = tp.all_reduce(hidden)
        else:
            hidden = tp.all_reduce(ops.linear(act(self._linear_parts(x, layer.gate_up)), layer.down))
        if layer.post_ffn_norm is not None:
            hidden = ops.post_norm(hidden, layer.post_ffn_norm, c.rms_eps)
        return hidden

    def _short_conv(self, x: torch.Tensor, conv: ConvWeights, state: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """LFM2's short convolution of the normalized ``x [T, H]``: ``out_proj(C * conv(B * x'))`` where in_proj
        gives B | C | x'; the convolution reads and updates each sequence's state (`meta.state_slots`)."""
        h = x.shape[1]
        bcx = self.ops.linear(x, conv.in_proj)
        conv_out = self.ops.short_conv(bcx[:, :h] * bcx[:, 2 * h :], conv.kernel, state, meta)
        return self.ops.linear(bcx[:, h : 2 * h] * conv_out, conv.out_proj)

    def _delta_net(self, x: torch.Tensor, dn: DeltaNetWeights, conv_state: torch.Tensor, state: torch.Tensor,
                   meta: BatchMetadata) -> torch.Tensor:
        """Qwen3.5's gated delta-net of the normalized ``x [T, H]`` (see `DeltaNetWeights`); the convolution and the
        delta rule read and update each sequence's states (`meta.state_slots`)."""
        c, ops = self.config, self.ops
        t, channels, inner, hv = x.shape[0], c.delta_conv_channels, c.ssm_inner_size, c.ssm_heads
        hk, dk, key_dims = c.ssm_groups, c.ssm_state_size, c.ssm_groups * c.ssm_state_size
        mixed = self._linear_parts(x, dn.in_proj)
        qkv = F.silu(ops.short_conv(mixed[:, :channels], dn.kernel, conv_state, meta))
        z = mixed[:, channels : channels + inner].view(t, hv, inner // hv)
        beta = torch.sigmoid(mixed[:, channels + inner : channels + inner + hv])
        decay = dn.decay * F.softplus(mixed[:, channels + inner + hv :] + dn.dt_bias)
        out = ops.gated_delta_rule(qkv[:, :key_dims].view(t, hk, dk), qkv[:, key_dims : 2 * key_dims].view(t, hk, dk),
                                   qkv[:, 2 * key_dims :].view(t, hv, inner // hv), decay, beta, state, meta)
        out = ops.head_rms_norm(out, dn.norm, c.rms_eps) * F.silu(z)
        return ops.linear(out.reshape(t, inner), dn.out)

    def _mamba(self, x: torch.Tensor, mw: MambaWeights, conv_state: torch.Tensor, state: torch.Tensor,
               meta: BatchMetadata) -> torch.Tensor:
        """A Mamba2 layer of the normalized ``x [T, H]`` (see `MambaWeights`); the convolution and the scan read and
        update each sequence's states (`meta.state_slots`)."""
        c, ops = self.config, self.ops
        y = ops.mamba2(ops.linear(x, mw.in_proj), (c.ssm_inner_size, c.ssm_heads, c.ssm_groups, c.ssm_state_size),
                       mw.kernel, mw.conv_bias, mw.dt_bias, mw.a, mw.d, mw.norm, c.rms_eps, conv_state, state, meta)
        return ops.linear(y, mw.out)

    def _latent_attention(self, x: torch.Tensor, layer: LayerWeights, cache: torch.Tensor,
                          meta: BatchMetadata) -> torch.Tensor:
        """Multi-head latent attention of the normalized ``x [T, H]`` (absorbed: the pool holds rotary | latent a
        token, each head attends over those rows with its no-rotary query mapped into the latent space by k_b, and
        v_b turns the weighted latents into its values), through o."""
        c, ops, mla = self.config, self.ops, layer.mla
        t, hq, r, lora = x.shape[0], self.num_heads, c.rotary_dim, c.kv_lora_rank
        xa = self._linear_parts(x, mla.x_a)
        split = xa.shape[1] - lora - r
        q = xa[:, :split]
        if mla.q_b is not None:
            q = ops.linear(ops.post_norm(q, mla.q_a_norm, c.rms_eps), mla.q_b)
        q = q.view(t, hq, c.qk_nope_dim + r)
        latent = ops.post_norm(xa[:, split : split + lora], mla.kv_a_norm, c.rms_eps)
        queries = torch.cat((q[..., c.qk_nope_dim :].float(), ops.heads_matmul(q[..., : c.qk_nope_dim], mla.k_b)), -1)
        rows = torch.cat((xa[:, split + lora :].float(), latent), dim=-1)[:, None, :]
        queries = ops.latent_rope_and_cache(queries, rows, self.rope_tables[layer.rope], cache, meta)
        attn = ops.latent_attention(queries, cache, meta, self.scale, r)  # [T, Hq, kv_lora_rank]
        return ops.linear(ops.heads_matmul(attn, mla.v_b).reshape(t, hq * c.v_head_dim), layer.o, layer.o_bias)

    def _layer_stack(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                     states: list[torch.Tensor] = ()):
        """`ops.layer_stack` over these pools (None: the backend has none, or it does not take this model), built
        once per pool."""
        key = tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in (k_caches[0], *v_caches[:1], *states[:1])) + (
            len(k_caches), len(states))
        if self._stack is None or self._stack[0] != key:
            self._stack = (key, self.ops.layer_stack(self, k_caches, v_caches, states))
        return self._stack[1]

    def _moe(self, x: torch.Tensor, moe: MoeWeights) -> torch.Tensor:
        """The MoE block of ``x [T, H]``: route, run the chosen experts, add the gated shared expert."""
        c, ops = self.config, self.ops
        ids, weights = ops.route(ops.linear(x, moe.router, moe.router_bias), c.num_experts_used, c.expert_gating,
                                 c.expert_weights_norm, c.expert_weights_scale, moe.choice_bias, c.expert_groups,
                                 c.expert_groups_used)
        out = ops.moe(x, ids, weights, moe.experts)
        if moe.shared_down is not None:
            shared = ops.linear(ops.silu_mul(self._linear_parts(x, moe.shared_gate_up)), moe.shared_down)
            if moe.shared_gate is not None:
                shared = shared * torch.sigmoid(x @ moe.shared_gate)[:, None]
            out = out + shared
        return out

    def _per_layer_ids(self, token_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """The token ids Gemma 4's per-layer table is read at: an image row's is the pad token's (transformers'
        `Gemma4Model.forward`, llama.cpp's padding row); its projection takes the image's embedding."""
        if meta.input_embeds is None:
            return token_ids
        ids = token_ids.clone()
        ids[meta.input_embeds[0]] = self.config.pad_token_id
        return ids

    def _per_layer_inputs(self, token_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs ``[T, layers, P]``: each token's row of the per-layer table times sqrt(P),
        plus the RMS-normalized projection of its (scaled) embedding over sqrt(H), over sqrt(2)."""
        c, ops = self.config, self.ops
        t, n, width = token_ids.shape[0], c.num_layers, c.per_layer_input_size
        table = ops.embedding(token_ids, self.per_layer_embedding, width**0.5).view(t, n, width)
        proj = ops.linear(embeddings, self.per_layer_proj) * c.hidden_size**-0.5
        proj = ops.post_norm(proj.reshape(t * n, width), self.per_layer_proj_norm, c.rms_eps).view(t, n, width)
        return (proj + table) * 2**-0.5

    def _lora_embedding(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: BatchMetadata) -> None:
        """Adds each adapter's ``token_embd`` product to its rows' embeddings (llama.cpp's ``build_inp_embd``: a
        token's row of A times B, times the embedding scale the rows then get)."""
        for g in meta.lora:
            if g.adapter.embedding is None:
                continue
            a, b = g.adapter.embedding
            delta = (a[token_ids[g.rows]] @ b.T) * (g.scales[:, None] * self.config.embedding_scale)
            hidden.index_add_(0, g.rows, delta.to(hidden.dtype))

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows ``[T, H]`` float32; under tensor parallelism each rank looks up the ids of its vocabulary
        slice (zero rows for the rest) and the all-reduce sums them."""
        c, ops = self.config, self.ops
        if self.tp.world_size == 1:
            return ops.embedding(token_ids, self.embedding, c.embedding_scale)
        local = token_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_rows)
        rows = ops.embedding(torch.where(inside, local, 0), self.embedding, c.embedding_scale)
        return self.tp.all_reduce(rows * inside[:, None])


def _add_pair(y: torch.Tensor, x: torch.Tensor, pair, rows: torch.Tensor, scales: torch.Tensor) -> None:
    """``y[rows, offset : offset + N] += scales * B (A x[rows])`` for one adapter's pair (float32 products)."""
    delta = ((x.index_select(0, rows).float() @ pair.a.T) * scales[:, None]) @ pair.b.T
    y[:, pair.offset : pair.offset + pair.b.shape[0]].index_add_(0, rows, delta.to(y.dtype))


def _add_deepstack(hidden: torch.Tensor, deepstack: tuple[torch.Tensor, torch.Tensor] | None, layer: int) -> None:
    """Qwen3-VL's deepstack: after `layer` (one of the first k), its image rows' features added to their stream
    (`hidden` is the layer's output; the residual it joins is added by the next norm)."""
    if deepstack is not None and layer < deepstack[1].shape[1]:
        rows, features = deepstack
        hidden[rows] += features[:, layer]


def _add_lora(y: torch.Tensor, x: torch.Tensor, groups: list, layer: int, site: str) -> None:
    """Adds the step's LoRA products of `site` (`gpullama.lora.SITES`) of layer `layer` to its output `y`, one
    matmul pair per adapter over the rows that use it (x: the matrix's input)."""
    for g in groups:
        for pair in g.adapter.layers[layer].get(site, ()):
            _add_pair(y, x, pair, g.rows, g.scales)
