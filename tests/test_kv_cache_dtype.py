"""The KV cache formats of the CPU fast path (engine argument `kv_cache_dtype`): float16 by default, q8_0 on request,
float32; their logits against transformers, the pool sizing that follows the format, and the errors."""

from __future__ import annotations

import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.engine.args import EngineArgs
from gpullama.engine.model_runner import kv_block_bytes
from gpullama.kernels import cpu_native
from tests.test_cpu_fast_path import FAST_TOLERANCE, assert_close_and_same_top1
from tests.test_model_parity import hf_logits, token_ids

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")

# max |logits - transformers'| / max |transformers'| with a Q8_0 KV cache: every cached k and v value is rounded to
# 1/254 of the largest magnitude of its 32 (llama.cpp's -ctk/-ctv q8_0). Measured on the tiny models below: 1.0e-3
# to 1.4e-2 (float16: 1.3e-4 to 5.8e-4, within FAST_TOLERANCE).
Q8_TOLERANCE = 3e-2

# head dims 32 (qwen3 Q8_0), 128 (qwen3 Q4_K), 256 with soft caps and sliding windows (gemma2); llama's is 16:
# float16 only (Q8_0 needs whole blocks of 32). The tiny gpt-oss (sinks, windows of 8, random attention biases that
# dwarf the rest of each 32 values) loses half its largest logit to Q8_0's rounding: float16 only.
CASES = [("qwen3", "Q8_0"), ("qwen3", "Q4_K"), ("gemma2", "Q8_0")]


@pytest.fixture(scope="module")
def kv_llm(tiny_model):
    """Factory: one fast-path LLM per (tiny model, kv_cache_dtype), reused within the module."""
    loaded: dict[tuple, LLM] = {}

    def get(arch: str, weight_type: str, kv: str) -> LLM:
        if (arch, weight_type, kv) not in loaded:
            loaded[arch, weight_type, kv] = LLM(str(tiny_model(arch, weight_type).path), device="cpu",
                                                kv_cache_dtype=kv)
        return loaded[arch, weight_type, kv]

    return get


@pytest.mark.parametrize(("arch", "weight_type", "kv", "tolerance"),
                         [(*case, "q8_0", Q8_TOLERANCE) for case in CASES]
                         + [(*case, "auto", FAST_TOLERANCE)
                            for case in [*CASES, ("gpt-oss", "MXFP4"), ("llama", "Q8_0")]])
def test_cache_format_logits_close_to_transformers(tiny_model, kv_llm, arch: str, weight_type: str, kv: str,
                                                   tolerance: float) -> None:
    """float16 (auto) and Q8_0: logits at every position of a 250-token sequence in one forward, and the next token after 200 of them from
    the decode path, against transformers in float32."""
    tiny = tiny_model(arch, weight_type)
    llm = kv_llm(arch, weight_type, kv)
    assert llm.engine.runner.kv_cache_format == ("float16" if kv == "auto" else kv)
    ids = token_ids(tiny.config.vocab_size, n=250)
    want = hf_logits(tiny.hf_model, ids)
    assert_close_and_same_top1(llm.logits(ids), want, f"{arch} {weight_type} kv {kv}", tolerance)
    out = llm.generate([ids[:200]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    top2 = want[199].topk(2).values
    if top2[0] - top2[1] > 2 * tolerance * want.abs().max():  # a clear winner
        assert out.token_ids[0] == int(want[199].argmax())


def test_pool_bytes_follow_the_format(tiny_model, kv_llm) -> None:
    """float16 blocks are half of float32's, Q8_0 blocks 34/128 of them (32 int8 and a float16 scale per 32), and
    the pool reserves that many bytes per block (kv_cache_memory buys 2x or 3.76x the tokens of float32)."""
    path = tiny_model("qwen3", "Q8_0").path
    c = kv_llm("qwen3", "Q8_0", "auto").config
    f32 = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4
    assert kv_block_bytes(c, 16, torch.float16) * 2 == f32
    assert kv_block_bytes(c, 16, torch.uint8) * 128 == f32 * 34
    for kv, per_block in (("auto", f32 // 2), ("q8_0", f32 * 34 // 128), ("float32", f32)):
        llm = LLM(str(path), device="cpu", kv_cache_dtype=kv,
                  kv_cache_memory=40 * f32, max_model_len=256)
        runner = llm.engine.runner
        assert runner.num_blocks == 40 * f32 // per_block
        assert runner.kv_cache_bytes == (runner.num_blocks + 1) * per_block  # the scratch block too


def test_bad_kv_cache_dtype_is_one_clear_error(tiny_model) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="'q8_0' needs the CPU fast path"):
        LLM(str(tiny_model("qwen3", "Q8_0").path), device="cpu", dtype="float32", kv_cache_dtype="q8_0")
    with pytest.raises(ValueError, match="q8_0 needs a head dim that is a multiple of 32"):
        LLM(str(tiny_model("llama", "Q8_0").path), device="cpu", kv_cache_dtype="q8_0")
