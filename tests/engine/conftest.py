"""Fixtures of the engine tests: the tiny llama model and the real default model, loaded once per session in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpullama import LLM

REAL_MAX_MODEL_LEN = 1024  # enough for the 300-token prefix tests; keeps the rope table and KV pool small
REAL_KV_BLOCKS = 160


@pytest.fixture(scope="package", autouse=True)
def one_intra_op_thread():
    """Run the engine tests on one torch thread: their many small steps are dominated by OpenMP hand-offs, which
    become 10-40x slower when the two CPU cores are shared with other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model) -> LLM:
    """The tiny random llama (2 layers, context 256, 707-token vocab) on the CPU in float32."""
    return LLM(str(tiny_model("llama", "F32").path), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def real_llm(default_model_path: Path) -> LLM:
    """The real SmolLM2-135M-Instruct on the CPU in float32, context cut to 1024 tokens."""
    return LLM(
        str(default_model_path),
        device="cpu",
        dtype="float32",
        max_model_len=REAL_MAX_MODEL_LEN,
        kv_cache_memory=REAL_KV_BLOCKS * _kv_block_bytes(default_model_path),
    )


def _kv_block_bytes(path: Path, block_size: int = 16) -> int:
    """Bytes of one float32 KV block (k and v, every layer) of the model at `path`."""
    from gpullama.gguf_file import read_gguf

    c = read_gguf(path).config
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * 4
