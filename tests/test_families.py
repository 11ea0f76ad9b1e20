"""Phi-3, Granite, Gemma 2 and Gemma 3 through the engine: batched like alone, on the exact float32 path and the
CPU fast path; and the metadata each family needs, with the errors when it is missing."""

from __future__ import annotations

import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.config import ModelConfig
from gpullama.gguf_file import read_gguf, read_header
from gpullama.kernels import cpu_native
from gpullama.model import Decoder
from gpullama.ops import CpuOps, TorchOps
from tests.engine.helpers import make_engine, random_prompt, run_requests, solo_runs
from tests.engine.test_batching import LogitsRecorder, assert_as_solo, assert_logits_match_solo
from tests.fixtures.tiny_models import SLIDING_WINDOW
from tests.test_cpu_fast_path import assert_close_and_same_top1
from tests.test_model_parity import PROMPT_LEN, SEQ_LEN, hf_logits, token_ids

FAMILIES = ("phi3", "granite", "gemma2", "gemma3")
MAX_TOKENS = 10


def family_prompts(vocab: int) -> list[list[int]]:
    """Eight prompts of 3..150 tokens (most longer than the windows, some longer than a step's budget), two
    sharing a 40-token prefix (so the second finds it in the prefix cache)."""
    gen = torch.Generator().manual_seed(11)
    prefix = random_prompt(gen, 40, vocab)
    prompts = [random_prompt(gen, n, vocab) for n in (3, 9, 17, 33, 70, 150)]
    return prompts + [prefix + random_prompt(gen, 5, vocab), prefix + random_prompt(gen, 30, vocab)]


@pytest.fixture(scope="module")
def family_llm(tiny_model):
    """Factory: one float32 LLM per tiny family model, reused within the module."""
    loaded: dict[str, LLM] = {}

    def get(arch: str) -> LLM:
        if arch not in loaded:
            loaded[arch] = LLM(str(tiny_model(arch, "F32").path), device="cpu", dtype="float32")
        return loaded[arch]

    return get


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_batch_equals_solo(family_llm, arch: str) -> None:
    """Chunked prefill across sliding windows, a cached prefix and requests joining as others leave: each request
    gets its solo greedy tokens, and every sampled logits row equals the row of the sequence scored alone."""
    llm = family_llm(arch)
    prompts = family_prompts(llm.config.vocab_size)
    assert max(len(p) for p in prompts) > 4 * max(SLIDING_WINDOW.values())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    solo = solo_runs(llm, prompts, params)
    engine = make_engine(llm, max_num_seqs=4, max_num_batched_tokens=48, static_decode=arch == "gemma3")
    recorder = LogitsRecorder(engine)
    seqs = run_requests(engine, prompts, params)
    assert_as_solo(seqs, solo, [params] * len(prompts), llm.tokenizer.eos_token_ids)
    assert sum(s.num_cached_tokens for s in seqs) > 0
    assert_logits_match_solo(llm, recorder)


FAST_CASES = [("phi3", "Q4_0"), ("granite", "Q4_0"), ("gemma2", "Q8_0"), ("gemma3", "Q4_K")]


@pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")
@pytest.mark.parametrize(("arch", "weight_type"), FAST_CASES)
def test_family_fast_path_close_to_transformers(tiny_model, arch: str, weight_type: str) -> None:
    """The CPU fast path (quantized weights, C kernels: partial rotary, sliding windows, soft caps, GeGLU, q/k and
    post norms, fused qkv / gate|up) against transformers on the same weights."""
    tiny = tiny_model(arch, weight_type)
    llm = LLM(str(tiny.path), device="cpu")
    assert isinstance(llm.model.ops, CpuOps)
    ids = token_ids(tiny.config.vocab_size, n=PROMPT_LEN.get(arch, 2 * SEQ_LEN))
    assert_close_and_same_top1(llm.logits(ids), hf_logits(tiny.hf_model, ids), f"{arch} {weight_type} fast")


@pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_fast_path_batch_equals_solo(tiny_model, arch: str) -> None:
    """Gemma 2 (soft caps) and 3 (two rope tables, q/k norms) on the fast path, sliding windows in both: batched
    greedy tokens are the solo ones."""
    llm = LLM(str(tiny_model(arch, "Q4_K").path), device="cpu")
    assert isinstance(llm.model.ops, CpuOps)
    prompts = family_prompts(llm.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    solo = solo_runs(llm, prompts, params)
    seqs = run_requests(make_engine(llm, max_num_seqs=4, max_num_batched_tokens=48), prompts, params)
    assert_as_solo(seqs, solo, [params] * len(prompts), llm.tokenizer.eos_token_ids)


# ---------------------------------------------------------------------------------------------------------------
# Metadata: what each family reads, and a clear error naming the key when a needed one is missing.
# ---------------------------------------------------------------------------------------------------------------
def test_family_configs_read_from_the_files(tiny_model) -> None:
    """The flags each tiny file's metadata and tensors give, against the transformers config it was built from."""
    phi3 = read_header(tiny_model("phi3").path).config
    hf = tiny_model("phi3").config
    assert (phi3.rotary_dim, phi3.sliding_window, phi3.rope_original_context) == (8, 12, 32)
    assert all(phi3.swa_layers) and phi3.rope_attn_factor > 1 and not phi3.permuted_qk
    granite, hf = read_header(tiny_model("granite").path).config, tiny_model("granite").config
    assert (granite.embedding_scale, granite.logit_scale) == (hf.embedding_multiplier, hf.logits_scaling)
    assert granite.residual_scale == pytest.approx(hf.residual_multiplier)
    assert granite.attention_scale == hf.attention_multiplier and granite.permuted_qk and not granite.swa_layers
    gemma2, hf = read_header(tiny_model("gemma2").path).config, tiny_model("gemma2").config
    assert gemma2.swa_layers == tuple(t == "sliding_attention" for t in hf.layer_types)
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (hf.attn_logit_softcapping, hf.final_logit_softcapping)
    assert gemma2.attention_scale == hf.query_pre_attn_scalar**-0.5 and gemma2.activation == "gelu_tanh"
    gemma3, hf = read_header(tiny_model("gemma3").path).config, tiny_model("gemma3").config
    assert gemma3.swa_layers == tuple(t == "sliding_attention" for t in hf.layer_types) == (True,) * 5 + (False,)
    assert (gemma3.rope_base, gemma3.rope_scale, gemma3.rope_base_swa, gemma3.rope_scale_swa) == (1e6, 8.0, 1e4, 1.0)
    assert gemma3.qk_norm and gemma3.post_norms and gemma3.final_softcap == 0 and gemma3.embedding_scale == 8.0


@pytest.mark.parametrize(("arch", "key"), [
    ("granite", "granite.logit_scale"),
    ("phi3", "phi3.block_count"),
    ("gemma2", "gemma2.embedding_length"),
    ("gemma3", "gemma3.attention.head_count"),
])
def test_missing_family_key_is_named(tiny_model, arch: str, key: str) -> None:
    meta = read_header(tiny_model(arch).path).metadata
    ModelConfig.from_metadata(meta)  # the file as written loads
    with pytest.raises(ValueError, match=f"missing metadata key '{key}'"):
        ModelConfig.from_metadata({k: v for k, v in meta.items() if k != key}, "model.gguf")


def test_longrope_factors_need_the_original_context(tiny_model) -> None:
    model = read_gguf(tiny_model("phi3").path)
    model.config.rope_original_context = 0  # as if the file had no rope.scaling.original_context_length
    with pytest.raises(ValueError, match="'phi3.rope.scaling.original_context_length'"):
        Decoder(model.config, model.tensors, TorchOps(torch.device("cpu")), max_positions=64)


@pytest.mark.parametrize(("base", "meta", "match"), [
    (None, {"general.architecture": "phimoe"}, "Phi-3.5-MoE is not supported"),
    (None, {"general.architecture": "gemma"}, "Gemma 1 is not supported"),
    (None, {"general.architecture": "gemma3n"}, "Gemma 3n is not supported"),
    ("gemma3", {"gemma3.rope.scaling.type": "longrope"}, "'gemma3.rope.scaling.type' = 'longrope'"),
    ("granite", {"granite.rope.scaling.finetuned": False}, "without rotary embedding"),
])
def test_unsupported_files_are_refused_with_the_reason(tiny_model, base: str | None, meta: dict, match: str) -> None:
    base_meta = read_header(tiny_model(base).path).metadata if base else {}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_metadata({**base_meta, **meta}, "model.gguf")
