"""Mixture-of-experts models (qwen3moe, qwen2moe, Mixtral, gpt-oss) against transformers float32 on tiny random
models written as llama.cpp's converter writes them: logits and greedy tokens on the exact float32 path and on the
CPU fast path, batched like alone, the config each file gives, and the files refused with the key that says why."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.config import ModelConfig
from gpullama.gguf_file import read_gguf, read_header
from gpullama.kernels import cpu_native
from gpullama.model import Decoder
from gpullama.ops import CpuOps, TorchOps
from gpullama.ops.cpu_weights import CpuExperts
from gpullama.quants import QTensor
from tests.engine.helpers import make_engine, run_requests, solo_runs
from tests.engine.test_batching import LogitsRecorder, assert_as_solo, assert_logits_match_solo
from tests.fixtures.quant_blocks import random_blocks
from tests.fixtures.tiny_models import EXPERTS_USED, GPT_OSS_ORIGINAL_CONTEXT, MOE_ARCHS, NUM_EXPERTS, SLIDING_WINDOW
from tests.ops.test_cpu_weights import rounded_input
from tests.test_cpu_fast_path import assert_close_and_same_top1
from tests.test_families import family_prompts
from tests.test_model_parity import SEQ_LEN, assert_close, hf_logits, token_ids

# one quantized file per family: K-quant, Q8_0 and Q4_0 experts, and gpt-oss's MXFP4 experts (Q8_0 elsewhere)
QUANTIZED = [("qwen3moe", "Q8_0"), ("mixtral", "Q4_K"), ("qwen2moe", "Q4_0"), ("gpt-oss", "MXFP4")]
GREEDY_TOKENS = 12
Q = gguf.GGMLQuantizationType
needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")


@pytest.fixture(scope="module")
def moe_llm(tiny_model):
    """Factory: one LLM per (arch, weight type, dtype) on the CPU, reused within the module."""
    loaded: dict[tuple, LLM] = {}

    def get(arch: str, weight_type: str = "F32", dtype: str = "float32") -> LLM:
        key = (arch, weight_type, dtype)
        if key not in loaded:
            loaded[key] = LLM(str(tiny_model(arch, weight_type).path), device="cpu", dtype=dtype)
        return loaded[key]

    return get


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids`: `n` tokens, argmax of the full forward each time."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def prompt_ids(tiny, n: int = SEQ_LEN) -> list[int]:
    return token_ids(tiny.config.vocab_size, n=n)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_f32_logits_and_greedy_match_transformers(tiny_model, moe_llm, arch: str) -> None:
    """Exact path, F32 file: logits within the dense tolerance of transformers', and its greedy tokens."""
    tiny = tiny_model(arch)
    llm = moe_llm(arch)
    ids = prompt_ids(tiny)
    assert_close(llm.logits(ids), hf_logits(tiny.hf_model, ids), f"{arch} F32")
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    got = llm.generate([ids], params)[0].token_ids
    assert got == hf_greedy(tiny.hf_model, ids, GREEDY_TOKENS)


@pytest.mark.parametrize(("arch", "weight_type"), QUANTIZED)
def test_quantized_logits_match_transformers(tiny_model, moe_llm, arch: str, weight_type: str) -> None:
    """Exact path, quantized experts: logits equal transformers' holding the file's dequantized weights."""
    tiny = tiny_model(arch, weight_type)
    ids = prompt_ids(tiny)
    assert_close(moe_llm(arch, weight_type).logits(ids), hf_logits(tiny.hf_model, ids), f"{arch} {weight_type}")


@needs_kernels
@pytest.mark.parametrize(("arch", "weight_type"), QUANTIZED)
def test_fast_path_close_to_transformers(tiny_model, moe_llm, arch: str, weight_type: str) -> None:
    """CPU fast path (experts packed quantized, one C kernel for the block; gpt-oss's sinks in the C attention):
    within the fast path's tolerance of transformers, the same top token where it is clear, the same greedy
    tokens as the exact path."""
    tiny = tiny_model(arch, weight_type)
    llm = moe_llm(arch, weight_type, "auto")
    assert isinstance(llm.model.ops, CpuOps)
    layer = llm.model.layers[0].moe
    assert isinstance(layer.experts.gate_up, CpuExperts) and isinstance(layer.experts.down, CpuExperts)
    ids = prompt_ids(tiny, 2 * SEQ_LEN)
    assert_close_and_same_top1(llm.logits(ids), hf_logits(tiny.hf_model, ids), f"{arch} {weight_type} fast")
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    exact = moe_llm(arch, weight_type).generate([ids[:SEQ_LEN]], params)[0].token_ids
    assert llm.generate([ids[:SEQ_LEN]], params)[0].token_ids == exact


@pytest.mark.parametrize(("arch", "weight_type", "dtype"), [
    ("gpt-oss", "F32", "float32"),
    pytest.param("qwen3moe", "Q8_0", "auto", marks=needs_kernels),
    pytest.param("gpt-oss", "MXFP4", "auto", marks=needs_kernels),
])
def test_batch_equals_solo(moe_llm, arch: str, weight_type: str, dtype: str) -> None:
    """Chunked prefill, a cached prefix, requests joining as others leave: each request gets its solo greedy
    tokens (the experts' rows grouped differently in every step); on the exact path every sampled logits row also
    equals the sequence's scored alone."""
    llm = moe_llm(arch, weight_type, dtype)
    prompts = family_prompts(llm.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    solo = solo_runs(llm, prompts, params)
    engine = make_engine(llm, max_num_seqs=4, max_num_batched_tokens=48)
    recorder = LogitsRecorder(engine) if dtype == "float32" else None
    seqs = run_requests(engine, prompts, params)
    assert_as_solo(seqs, solo, [params] * len(prompts), llm.tokenizer.eos_token_ids)
    assert sum(s.num_cached_tokens for s in seqs) > 0
    if recorder is not None:
        assert_logits_match_solo(llm, recorder)


@needs_kernels
def test_fast_moe_kernel_matches_the_reference_and_ignores_the_batch(tiny_model) -> None:
    """The C MoE block against `TorchOps.moe` on the same (dequantized) experts, for every active-expert pattern
    of a batch (tokens sharing experts, an expert with more rows than one tile of the matmul's 8); each row
    bit-identical alone."""
    model = read_gguf(tiny_model("gpt-oss", "MXFP4").path)
    p = "blk.1."
    gate_up = [model.tensors[p + "ffn_gate_exps.weight"], model.tensors[p + "ffn_up_exps.weight"]]
    down = model.tensors[p + "ffn_down_exps.weight"]
    biases = (torch.cat([model.tensors[p + "ffn_gate_exps.bias"].dequantize(),
                         model.tensors[p + "ffn_up_exps.bias"].dequantize()], dim=-1),
              model.tensors[p + "ffn_down_exps.bias"].dequantize())
    fast, exact = CpuOps(torch.device("cpu")), TorchOps(torch.device("cpu"))
    for activation in ("swiglu_oai", "silu", "gelu_tanh"):  # gpt-oss's, the others', Gemma 4's
        experts = [ops.prepare_experts(gate_up, down, *biases, activation=activation) for ops in (fast, exact)]
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(20, down.shape[1], generator=gen)
        ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:EXPERTS_USED] for _ in range(20)])
        ids[:11, 0] = 3  # expert 3 serves at least eleven rows
        weights = torch.rand(20, EXPERTS_USED, generator=gen)
        got = fast.moe(x, ids, weights, experts[0])
        want = exact.moe(x, ids, weights, experts[1])
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3, activation
        for t in (0, 4, 10, 19):
            alone = fast.moe(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], experts[0])
            assert torch.equal(alone[0], got[t]), f"{activation}: row {t} differs alone"


@needs_kernels
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_fast_moe_kernel_is_each_expert_on_its_rounded_inputs(qtype, bits: int) -> None:
    """The C MoE block on K-quant experts with CpuOps' activation bits: each token's rows quantized once, then
    gathered by expert (with 8 bits, one d each 256 values and the mins' sums of Q that go with them), is each
    chosen expert's ``rounded_input`` matmuls in float64 (gate|up on the rounded x, down on the rounded
    silu(gate) * up), summed with the routing weights; and a row alone is the same bits."""
    e, hidden, inter, t, k = 4, 512, 256, 20, 2
    raw = [random_blocks(qtype, e * inter, hidden, 1), random_blocks(qtype, e * inter, hidden, 2),
           random_blocks(qtype, e * hidden, inter, 3)]
    ref = [torch.from_numpy(gguf.quants.dequantize(r, qtype).astype(np.float32)).double() for r in raw]
    gate, up = (QTensor(torch.from_numpy(r), qtype, (e, inter, hidden)) for r in raw[:2])
    down = QTensor(torch.from_numpy(raw[2]), qtype, (e, hidden, inter))
    wg, wu, wd = ref[0].view(e, inter, hidden), ref[1].view(e, inter, hidden), ref[2].view(e, hidden, inter)
    ops = CpuOps(torch.device("cpu"), activation_bits=bits)
    experts = ops.prepare_experts([gate, up], down)
    assert isinstance(experts.gate_up, CpuExperts)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(t, hidden, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[:11, 0] = 3  # expert 3 serves more rows than one tile of 8
    weights = torch.rand(t, k, generator=gen)
    got = ops.moe(x, ids, weights, experts)
    want = torch.zeros(t, hidden, dtype=torch.float64)
    for row in range(t):
        seen = rounded_input(x[row : row + 1], bits, qtype).double()
        for j in range(k):
            n = int(ids[row, j])
            h = (torch.nn.functional.silu(seen @ wg[n].T) * (seen @ wu[n].T)).float()
            want[row] += float(weights[row, j]) * (rounded_input(h, bits, qtype).double() @ wd[n].T)[0]
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    for row in (0, 4, 10, 19):
        assert torch.equal(ops.moe(x[row : row + 1], ids[row : row + 1], weights[row : row + 1], experts)[0], got[row])


def test_configs_read_from_the_files(tiny_model) -> None:
    """What each MoE file says: expert counts and sizes (from the tensors), routing, gpt-oss's YaRN, window and
    sinks, against the transformers config each was built from."""
    for arch in MOE_ARCHS:
        c, hf = read_header(tiny_model(arch).path).config, tiny_model(arch).config
        assert (c.num_experts, c.num_experts_used) == (NUM_EXPERTS, EXPERTS_USED), arch
        expert_rows = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
        assert c.expert_intermediate_size == expert_rows, arch
    qwen3, qwen2 = read_header(tiny_model("qwen3moe").path).config, read_header(tiny_model("qwen2moe").path).config
    assert qwen3.expert_weights_norm and qwen3.qk_norm and qwen3.expert_gating == "softmax"
    assert not qwen2.expert_weights_norm and qwen2.attention_bias
    assert qwen2.shared_expert_intermediate_size == tiny_model("qwen2moe").config.shared_expert_intermediate_size
    mixtral = read_header(tiny_model("mixtral").path).config
    assert mixtral.architecture == "llama" and mixtral.permuted_qk and mixtral.expert_weights_norm
    oss, hf = read_header(tiny_model("gpt-oss").path).config, tiny_model("gpt-oss").config
    assert oss.expert_gating == "softmax_topk" and oss.expert_activation == "swiglu_oai"
    assert oss.attn_sinks and oss.attn_output_bias and oss.attention_bias and oss.ffn_norm_tensor == "post_attention_norm"
    assert oss.swa_layers == tuple(t == "sliding_attention" for t in hf.layer_types)
    assert oss.sliding_window == SLIDING_WINDOW["gpt-oss"] and oss.head_dim == hf.head_dim
    assert oss.rope_yarn and not oss.rope_yarn_truncate and oss.rope_scale == hf.rope_parameters["factor"]
    assert oss.rope_original_context == GPT_OSS_ORIGINAL_CONTEXT


@pytest.mark.parametrize(("base", "meta", "match"), [
    (None, {"general.architecture": "granitemoe"}, "Granite MoE is not supported"),
    ("qwen3moe", {"qwen3moe.expert_gating_func": 4}, "'qwen3moe.expert_gating_func' = 4"),
    ("qwen3moe", {"qwen3moe.expert_used_count": 9}, "'qwen3moe.expert_used_count' = 9"),
    ("qwen2moe", {"qwen2moe.expert_group_count": 4}, "'qwen2moe.expert_group_count' = 4"),
    ("gpt-oss", {"gpt-oss.rope.scaling.yarn_log_multiplier": 0.1}, "'gpt-oss.rope.scaling.yarn_log_multiplier'"),
    ("gpt-oss", {"gpt-oss.rope.scaling.original_context_length": 0}, "'gpt-oss.rope.scaling.original_context"),
])
def test_unsupported_moe_files_are_refused_naming_the_key(tiny_model, base, meta: dict, match: str) -> None:
    base_meta = read_header(tiny_model(base).path).metadata if base else {}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_metadata({**base_meta, **meta}, "model.gguf")


def test_missing_expert_count_and_old_per_expert_tensors_are_named(tiny_model) -> None:
    meta = read_header(tiny_model("qwen3moe").path).metadata
    with pytest.raises(ValueError, match="missing metadata key 'qwen3moe.expert_count'"):
        ModelConfig.from_metadata({k: v for k, v in meta.items() if k != "qwen3moe.expert_count"}, "model.gguf")
    model = read_gguf(tiny_model("mixtral").path)
    tensors = {k.replace("ffn_gate_exps", "ffn_gate.0"): v for k, v in model.tensors.items()
               if "ffn_gate_inp" not in k}
    from gpullama.gguf_file import _set_tensor_flags

    with pytest.raises(ValueError, match="one tensor per expert.*blk.0.ffn_gate.0.weight"):
        _set_tensor_flags(model.config, {k: v.shape for k, v in tensors.items()})
    with pytest.raises(ValueError, match="'blk.0.ffn_down_exps.weight'"):
        Decoder(model.config, {k: v for k, v in model.tensors.items() if "ffn_down_exps" not in k},
                TorchOps(torch.device("cpu")), max_positions=64)
