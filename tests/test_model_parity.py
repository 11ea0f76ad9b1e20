"""gpullama's logits against transformers' on tiny random models of every architecture, float and quantized."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch

import gpullama
from tests.fixtures.tiny_models import (
    ARCHS,
    GGUF_LOADABLE,
    PHI3_ORIGINAL_CONTEXT,
    SLIDING_WINDOW,
    TinyModel,
    build_tiny_model,
    llama3_rope_factors,
    load_gguf_reference,
)

SEQ_LEN = 20  # longer than every tiny model's sliding window
TOLERANCE = 1e-4  # max |got - want| / max |want|, float32 on both sides
# Phi-3 runs with its context (256) past the original one (32), so it uses LongRoPE's long factors; transformers
# picks them for sequences longer than the original context: its prompts are that long.
PROMPT_LEN = {"phi3": PHI3_ORIGINAL_CONTEXT + 8}

# (arch, weight type) pairs checked against transformers loading the very same quantized file.
QUANTIZED_CASES = [
    ("llama", "Q8_0"),
    ("qwen2", "Q8_0"),
    ("mistral", "Q4_0"),
    ("qwen3", "Q4_0"),
    ("llama", "Q4_K"),
    ("llama", "Q6_K"),
    ("phi3", "Q8_0"),
    ("gemma2", "Q4_0"),
    ("gemma3", "Q4_K"),
]


def token_ids(vocab_size: int, n: int = SEQ_LEN, seed: int = 1234) -> list[int]:
    """A fixed random sequence of token ids (no BOS)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=gen).tolist()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `ids`, float32 [len(ids), vocab]."""
    return model(torch.tensor([ids])).logits[0].float()


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tolerance: float = TOLERANCE) -> None:
    """Relative max error below `tolerance`; on failure name the first position that differs."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    err = (got - want).abs()
    rel = err.max().item() / scale
    if not rel < tolerance:
        per_pos = (err.amax(dim=-1) / scale).tolist()
        first = next(i for i, e in enumerate(per_pos) if e >= tolerance)
        raise AssertionError(
            f"{what}: max rel error {rel:.3g} >= {tolerance:g}; first bad position {first}; "
            f"per-position rel error {[f'{e:.1g}' for e in per_pos]}"
        )


@pytest.fixture(scope="module")
def gpullama_llm() -> Callable[[TinyModel], gpullama.LLM]:
    """Factory: one gpullama.LLM on the CPU in float32 per tiny model file, reused within the module."""
    loaded: dict[str, gpullama.LLM] = {}

    def get(tiny: TinyModel) -> gpullama.LLM:
        key = str(tiny.path)
        if key not in loaded:
            loaded[key] = gpullama.LLM(key, device="cpu", dtype="float32")
        return loaded[key]

    return get


def test_prompts_reach_past_the_sliding_windows() -> None:
    """The parity prompts are longer than every tiny model's window, so windowed attention is exercised."""
    assert min(SEQ_LEN, *PROMPT_LEN.values()) > max(SLIDING_WINDOW.values())


@pytest.mark.parametrize("arch", GGUF_LOADABLE)
def test_gguf_writer_round_trips_through_transformers(tiny_model, arch: str) -> None:
    """transformers loading our F32 GGUF (un-permuting Q/K itself) gives back the original model exactly."""
    tiny = tiny_model(arch, "F32")
    reference = load_gguf_reference(tiny)
    want_state = tiny.hf_model.state_dict()
    got_state = reference.state_dict()
    assert set(got_state) == set(want_state)
    for name, value in want_state.items():
        assert torch.equal(got_state[name], value), f"{arch}: {name} differs after the GGUF round trip"
    ids = token_ids(tiny.config.vocab_size, n=PROMPT_LEN.get(arch, SEQ_LEN))
    assert_close(hf_logits(reference, ids), hf_logits(tiny.hf_model, ids), f"{arch} transformers-from-GGUF")


@pytest.mark.parametrize(("arch", "weight_type"), QUANTIZED_CASES)
def test_quantized_file_holds_the_hf_weights(tiny_model, arch: str, weight_type: str) -> None:
    """transformers dequantizing the quantized file gets exactly the weights the fixture's HF model holds."""
    tiny = tiny_model(arch, weight_type)
    got_state = load_gguf_reference(tiny).state_dict()
    for name, value in tiny.hf_model.state_dict().items():
        assert torch.equal(got_state[name], value), f"{arch} {weight_type}: {name} differs"


def test_rope_freqs_match_transformers_llama3_scaling(tiny_model) -> None:
    """`rope_freqs.weight` is the ratio of transformers' unscaled to llama3-scaled inverse frequencies."""
    tiny = tiny_model("llama", "F32")
    reader = gguf.GGUFReader(tiny.path)
    stored = np.array(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data, dtype=np.float32)
    np.testing.assert_array_equal(stored, llama3_rope_factors(tiny.config))
    assert (stored > 1).any(), "the tiny config should rescale some frequencies"
    scaled = tiny.hf_model.model.rotary_emb.inv_freq.double()
    dim = tiny.config.head_dim
    plain = 1.0 / (tiny.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).double() / dim))
    torch.testing.assert_close(torch.from_numpy(stored).double(), plain / scaled, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_transformers(tiny_model, gpullama_llm, arch: str) -> None:
    """F32 file: gpullama's logits equal the original transformers model's."""
    tiny = tiny_model(arch, "F32")
    llm = gpullama_llm(tiny)
    ids = token_ids(tiny.config.vocab_size, n=PROMPT_LEN.get(arch, SEQ_LEN))
    got = llm.logits(ids)
    assert got.dtype == torch.float32
    assert_close(got, hf_logits(tiny.hf_model, ids), f"{arch} F32")


def test_phi3_short_factors_within_the_original_context(tiny_model) -> None:
    """Phi-3 served within its original context uses LongRoPE's short factors (as llama.cpp picks them), which is
    what transformers uses for sequences that short."""
    tiny = tiny_model("phi3", "F32")
    llm = gpullama.LLM(str(tiny.path), device="cpu", dtype="float32", max_model_len=PHI3_ORIGINAL_CONTEXT)
    ids = token_ids(tiny.config.vocab_size, n=PHI3_ORIGINAL_CONTEXT - 1)  # (scoring leaves room for one token)
    assert_close(llm.logits(ids), hf_logits(tiny.hf_model, ids), "phi3 short factors")


@pytest.mark.parametrize(("arch", "weight_type"), QUANTIZED_CASES)
def test_quantized_logits_match_transformers_from_gguf(
    tiny_model, gpullama_llm, arch: str, weight_type: str
) -> None:
    """Quantized file: gpullama's logits equal transformers' loading (and dequantizing) the very same GGUF."""
    tiny = tiny_model(arch, weight_type)
    llm = gpullama_llm(tiny)
    ids = token_ids(tiny.config.vocab_size, n=PROMPT_LEN.get(arch, SEQ_LEN))
    assert_close(llm.logits(ids), hf_logits(load_gguf_reference(tiny), ids), f"{arch} {weight_type}")


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q6_K"])
def test_granite_quantized_logits_match_transformers(tiny_model, gpullama_llm, weight_type: str) -> None:
    """Granite (whose GGUF transformers does not load) against its HF model holding the file's dequantized
    weights."""
    tiny = tiny_model("granite", weight_type)
    ids = token_ids(tiny.config.vocab_size)
    assert_close(gpullama_llm(tiny).logits(ids), hf_logits(tiny.hf_model, ids), f"granite {weight_type}")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_prefix_logits_equal_first_rows_of_longer_sequence(tiny_model, gpullama_llm, arch: str) -> None:
    """Causality: the logits of a prefix are the first rows of the logits of a longer sequence."""
    tiny = tiny_model(arch, "F32")
    llm = gpullama_llm(tiny)
    ids = token_ids(tiny.config.vocab_size, n=32, seed=99)
    full = llm.logits(ids)
    prefix = llm.logits(ids[:13])
    assert_close(prefix, full[:13], f"{arch} prefix", tolerance=1e-5)


def test_build_rejects_unknown_arch_and_weight_type(tmp_path) -> None:
    """Bad fixture arguments raise one ValueError naming the value and the supported ones."""
    with pytest.raises(ValueError, match="unknown arch 'gpt2'.*llama, mistral, qwen2, qwen3, phi3, granite"):
        build_tiny_model("gpt2", tmp_path)
    with pytest.raises(ValueError, match="unknown weight_type 'Q5_1'.*Q4_K"):
        build_tiny_model("llama", tmp_path, "Q5_1")
