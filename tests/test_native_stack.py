"""The CPU fast path's decoder stack (`gpullama.ops.cpu_stack`: every layer of a step in one C call) against the
layer loop it stands in for (one kernel call at a time; itself tested against transformers in
test_cpu_fast_path.py, test_families.py and test_moe.py): the same logits, bit for bit, on the dense families, in
prefill and in batched decode; on the MoE families within the float32 rounding of the router's softmax, with the
same greedy tokens; and the models it leaves to the loop."""

from __future__ import annotations

import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.kernels import cpu_native
from gpullama.ops import CpuOps
from gpullama.ops.cpu_stack import NativeStack
from tests.test_model_parity import token_ids

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")

# each thing the stack reads: biases (qwen2), q/k norms (qwen3, gemma3), fused q|k|v and partial rotary (phi3),
# post norms, GeGLU and soft-capped scores (gemma2), two rope tables and sliding windows (gemma3), the residual scale
# (granite), 5-bit, K-quant and 6-bit blocks, float16 and Q8_0 KV pools (Granite 4.0-H's Mamba2 layers:
# tests/test_converted_models.py)
DENSE = [
    ("llama", "Q4_0", {}), ("qwen2", "Q8_0", {}), ("qwen3", "Q4_K", {}), ("phi3", "Q4_0", {}),
    ("gemma2", "Q8_0", {}), ("gemma3", "Q4_K", {}), ("granite", "Q4_0", {}), ("llama", "Q6_K", {"kv_cache_dtype": "q8_0"}),
]
MOE = [("qwen3moe", "Q8_0"), ("mixtral", "Q4_K"), ("gpt-oss", "MXFP4")]
# max |stack - loop| / max |loop| over the logits: the router's softmax sums in another order than torch's, and a
# last-bit change of an expert weight can move an activation across a rounding of the matmuls' 16-bit activations
# (1 part in 64516 of a group's largest); measured up to 4.2e-5 (gpt-oss), a tenth of the fast path's tolerance
MOE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def stack_llm(tiny_model):
    """Factory: one fast-path LLM per (arch, weight type, engine args), reused within the module."""
    loaded: dict[tuple, LLM] = {}

    def get(arch: str, weight_type: str, **kwargs) -> LLM:
        key = (arch, weight_type, repr(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = LLM(str(tiny_model(arch, weight_type).path), device="cpu", **kwargs)
        return loaded[key]

    return get


def stack_of(llm: LLM) -> NativeStack | None:
    runner = llm.engine.runner
    return llm.model.ops.layer_stack(llm.model, runner.k_caches, runner.v_caches)


def both(llm: LLM, run):
    """`run(llm)` with the stack, then with the layer loop."""
    llm.model.native_stack = True
    with_stack = run(llm)
    llm.model.native_stack = False
    try:
        return with_stack, run(llm)
    finally:
        llm.model.native_stack = True


def decode(llm: LLM) -> list:
    """Two prompts decoded together (paged attention over two sequences, one token each a step): each one's
    tokens and the logprobs of its top 4 at every step."""
    vocab = llm.config.vocab_size
    prompts = [token_ids(vocab, n=23), token_ids(vocab, n=9)[::-1]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=4)
    return [(o.token_ids, o.logprobs) for o in (r.outputs[0] for r in llm.generate(prompts, params))]


@pytest.mark.parametrize(("arch", "weight_type", "kwargs"), DENSE, ids=[f"{a}-{w}" for a, w, _ in DENSE])
def test_dense_stack_is_the_loop_bit_for_bit(stack_llm, arch: str, weight_type: str, kwargs: dict) -> None:
    llm = stack_llm(arch, weight_type, **kwargs)
    assert isinstance(llm.model.ops, CpuOps) and stack_of(llm) is not None
    ids = token_ids(llm.config.vocab_size, n=40)
    got, want = both(llm, lambda m: m.logits(ids))
    assert torch.equal(got, want), f"prefill: max difference {(got - want).abs().max().item():.3g}"
    got, want = both(llm, decode)
    assert got == want


@pytest.mark.parametrize(("arch", "weight_type"), MOE)
def test_moe_stack_is_the_loop_up_to_the_router_rounding(stack_llm, arch: str, weight_type: str) -> None:
    llm = stack_llm(arch, weight_type)
    assert stack_of(llm) is not None
    ids = token_ids(llm.config.vocab_size, n=40)
    got, want = both(llm, lambda m: m.logits(ids))
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < MOE_TOLERANCE, f"max rel difference {rel:.3g}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    got, want = both(llm, decode)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]


@pytest.mark.parametrize(("arch", "weight_type", "why"), [
    ("qwen2moe", "Q4_0", "a sigmoid-gated shared expert"),
])
def test_what_the_stack_leaves_to_the_loop(stack_llm, caplog, arch: str, weight_type: str, why: str) -> None:
    llm = stack_llm(arch, weight_type)
    with caplog.at_level("DEBUG", logger="gpullama"):
        assert stack_of(llm) is None
    assert why in caplog.text
