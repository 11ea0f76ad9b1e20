"""Fixtures of the structured-output tests: real vocabularies (SmolLM2's and small trained ones) and their backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpullama.tokenizer import Tokenizer
from tests.fixtures.vocabs import vocab_metadata


@pytest.fixture(scope="session")
def smollm_tokenizer(default_model_path: Path) -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer (49152 byte-level BPE tokens, 17 control tokens)."""
    from gpullama.gguf_file import read_gguf

    return Tokenizer.from_metadata(read_gguf(str(default_model_path)).metadata)


@pytest.fixture(scope="session")
def vocab_tokenizer():
    """Factory `vocab_tokenizer(kind)`: the tokenizer of a small trained vocabulary (tests/fixtures/vocabs.py)."""
    built: dict[str, Tokenizer] = {}

    def get(kind: str) -> Tokenizer:
        if kind not in built:
            built[kind] = Tokenizer.from_metadata(vocab_metadata(kind))
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tokenizers(smollm_tokenizer, vocab_tokenizer) -> dict[str, Tokenizer]:
    """The vocabularies the grammar tests decode on: SmolLM2's, a Qwen2-style BPE (user-defined <think>) and a
    SentencePiece one (byte fallback, control [INST], user-defined <|tool|>)."""
    return {"smollm2": smollm_tokenizer, "qwen2": vocab_tokenizer("qwen2"), "spm": vocab_tokenizer("llama-spm")}
