"""The CPU fast path (dtype auto on a quantized file: quantized weights, C kernels) against transformers and the
exact float32 path, its batch invariance, and how the mode is chosen."""

from __future__ import annotations

import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.kernels import cpu_native
from gpullama.ops import CpuOps, TorchOps
from tests.engine.helpers import PASSAGE, make_engine, run_requests, solo_runs
from tests.engine.test_batching import assert_as_solo, assert_same_outputs, mixed_params, mixed_prompts
from tests.test_model_parity import hf_logits, token_ids

# max |fast - reference| / max |reference| over the logits. The matmuls see each 32 activations rounded to multiples
# of their largest magnitude / 32258 (16-bit integers); measured: 2.8e-5 to 2.1e-4 on the tiny models against
# transformers, 2.6e-4 on SmolLM2 against the float32 path.
FAST_TOLERANCE = 1e-3

CASES = [("llama", "Q8_0"), ("qwen2", "Q8_0"), ("mistral", "Q4_0"), ("qwen3", "Q4_K"), ("llama", "Q6_K")]

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")


def assert_close_and_same_top1(got: torch.Tensor, want: torch.Tensor, what: str,
                               tolerance: float = FAST_TOLERANCE) -> None:
    """Logits within `tolerance` of the reference, and the same top token at every position where the
    reference's top two are further apart than twice that position's largest error (closer ties may go either
    way; those are at most a quarter of the positions)."""
    err = (got - want).abs().amax(dim=-1)
    rel = err.max().item() / want.abs().max().item()
    assert rel < tolerance, f"{what}: max rel error {rel:.3g}"
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert clear.sum() >= 3 * len(want) // 4, f"{what}: only {int(clear.sum())} of {len(want)} positions are clear"
    agree = got.argmax(-1) == want.argmax(-1)
    assert agree[clear].all(), f"{what}: top-1 differs at clear positions {(~agree & clear).nonzero().flatten().tolist()}"


@pytest.fixture(scope="module")
def fast_llm():
    """Factory: one fast-path LLM (dtype auto on the CPU) per tiny model file, reused within the module."""
    loaded: dict[str, LLM] = {}

    def get(path, **kwargs) -> LLM:
        key = str(path) + repr(sorted(kwargs.items()))
        if key not in loaded:
            loaded[key] = LLM(str(path), device="cpu", **kwargs)
        return loaded[key]

    return get


def test_auto_picks_the_fast_path_for_quantized_files_only(tiny_model, fast_llm) -> None:
    quantized = fast_llm(tiny_model("llama", "Q4_0").path)
    assert isinstance(quantized.model.ops, CpuOps) and quantized.dtype == torch.float32
    assert "quantized weights" in quantized.model.ops.mode
    exact = fast_llm(tiny_model("llama", "Q4_0").path, dtype="float32")
    assert type(exact.model.ops) is TorchOps and exact.model.ops.mode == "dense float32"
    unquantized = fast_llm(tiny_model("llama", "F32").path)
    assert type(unquantized.model.ops) is TorchOps and unquantized.dtype == torch.float32


def test_threads_sets_torch_threads(tiny_model) -> None:
    before = torch.get_num_threads()
    try:
        LLM(str(tiny_model("llama", "Q4_0").path), device="cpu", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("arch", "weight_type"), CASES)
def test_fast_logits_close_to_transformers(tiny_model, fast_llm, arch: str, weight_type: str) -> None:
    """The fast path's logits at every position against transformers on the same (dequantized) weights."""
    tiny = tiny_model(arch, weight_type)
    llm = fast_llm(tiny.path)
    assert isinstance(llm.model.ops, CpuOps)
    ids = token_ids(tiny.config.vocab_size, n=40)
    assert_close_and_same_top1(llm.logits(ids), hf_logits(tiny.hf_model, ids), f"{arch} {weight_type}")


def test_smollm2_fast_logits_close_to_float32(default_llm: LLM, fast_default_llm: LLM) -> None:
    """SmolLM2 on the fast path against the exact float32 path (itself within 1e-4 of transformers)."""
    ids = default_llm.tokenizer.encode(" ".join(PASSAGE.split()[:40]), add_special_tokens=True)[:60]
    assert_close_and_same_top1(fast_default_llm.logits(ids), default_llm.logits(ids), "SmolLM2 fast vs float32")


def test_smollm2_fast_path_says_paris(fast_default_llm: LLM) -> None:
    prompt = fast_default_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    text = fast_default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0].text
    assert "Paris" in text


@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "static"])
def test_fast_path_batch_equals_solo(tiny_model, fast_llm, static_decode: bool) -> None:
    """16 mixed prompts (chunked prefill, shared prefixes, requests joining as others leave) give each prompt
    exactly the greedy tokens it gets alone."""
    llm = fast_llm(tiny_model("llama", "Q4_0").path)
    solo = solo_runs(llm, mixed_prompts(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine = make_engine(llm, max_num_seqs=5, max_num_batched_tokens=64, static_decode=static_decode)
    seqs = run_requests(engine, mixed_prompts(), mixed_params())
    assert_as_solo(seqs, solo, mixed_params(), llm.tokenizer.eos_token_ids)


def test_smollm2_fast_path_batch_equals_solo(fast_default_llm: LLM) -> None:
    """SmolLM2 on the fast path: real-text prompts batched with chunked prefill get their solo greedy tokens."""
    tok = fast_default_llm.tokenizer
    words = PASSAGE.split()
    texts = ["The capital of France is", " ".join(words[:30]), " ".join(words[:30]) + " The keepers",
             " ".join(words[60:80]), "Water boils at"]
    prompts = [tok.encode(t, add_special_tokens=True) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = make_engine(fast_default_llm, max_num_seqs=8, max_num_batched_tokens=16)
    assert_same_outputs(run_requests(engine, prompts, params), solo_runs(fast_default_llm, prompts, params))


@pytest.mark.parametrize("arch, weight_type", [("llama", "Q4_K"), ("qwen2", "Q8_0")])
def test_bytes_a_token_reads_are_the_files(arch, weight_type, tiny_model, fast_llm) -> None:
    """`model_size().active_bytes` (what `gpullama info` prints as read a token) against the weight bytes the fast
    path's kernels count over a generation: the matrices and the whole output head (the embedding table itself in
    the tied tiny qwen2, llama's own output.weight), within 5% (Q4_K's sub-scales held as bytes, the norms)."""
    from gpullama.gguf_file import model_size, read_header

    model = tiny_model(arch, weight_type)
    header = read_header(str(model.path))
    assert any(t.name == "output.weight" for t in header.tensors) == (arch == "llama")
    llm = fast_llm(model.path)
    before = cpu_native.matmul_bytes_read()
    llm.generate([[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    per_forward = (cpu_native.matmul_bytes_read() - before) / 8  # a 1-token prompt, then 7 decode steps
    assert 0.95 < model_size(header).active_bytes / per_forward < 1.05


# 8-bit activations (cpu_activation_bits=8): each 32 activations rounded to multiples of their largest magnitude / 127,
# as llama.cpp's Q8 activations; measured on tiny random models against transformers: 1.5e-2 to 3.9e-2 (the largest on
# llama Q6_K, whose near ties leave too few clear positions for the top-1 check); 16-bit: 9e-5 to 8e-4
EIGHT_BIT_TOLERANCE = 8e-2


@pytest.mark.parametrize(("arch", "weight_type"), [("llama", "Q4_0"), ("qwen3", "Q4_K"), ("qwen2", "Q8_0")])
def test_eight_bit_activations_close_to_transformers(tiny_model, fast_llm, arch: str, weight_type: str) -> None:
    """With 8-bit activations the fast path's logits stay near transformers' on the same weights, further than
    with 16-bit ones."""
    tiny = tiny_model(arch, weight_type)
    eight, sixteen = fast_llm(tiny.path, cpu_activation_bits=8), fast_llm(tiny.path)
    assert eight.model.ops.activation_bits == 8 and "8-bit in the matmuls" in eight.model.ops.mode
    ids = token_ids(tiny.config.vocab_size, n=40)
    want = hf_logits(tiny.hf_model, ids)
    got = eight.logits(ids)
    assert_close_and_same_top1(got, want, f"{arch} {weight_type} 8-bit", EIGHT_BIT_TOLERANCE)
    assert (got - want).abs().max() > (sixteen.logits(ids) - want).abs().max()  # the 8 bits are in use


def test_eight_bit_batch_equals_solo(tiny_model, fast_llm) -> None:
    """8-bit activations keep each row's arithmetic its own: mixed batches give every prompt its solo tokens."""
    llm = fast_llm(tiny_model("llama", "Q4_K").path, cpu_activation_bits=8)
    solo = solo_runs(llm, mixed_prompts(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine = make_engine(llm, max_num_seqs=5, max_num_batched_tokens=64)
    seqs = run_requests(engine, mixed_prompts(), mixed_params())
    assert_as_solo(seqs, solo, mixed_params(), llm.tokenizer.eos_token_ids)


def test_activation_bits_other_than_16_or_8_are_refused(tiny_model) -> None:
    with pytest.raises(ValueError, match="cpu_activation_bits must be 16 or 8, got 4"):
        LLM(str(tiny_model("llama", "Q4_0").path), device="cpu", cpu_activation_bits=4)
