"""The grammar vocabulary: token bytes as the detokenizer outputs them, special tokens empty, EOS ids."""

from __future__ import annotations

import pytest

from gpullama.structured.vocab import grammar_vocab, stop_token_ids
from gpullama.tokenizer import BYTE, NORMAL, Tokenizer


def _kinds(tok: Tokenizer) -> list[int]:
    return tok._types


@pytest.mark.parametrize("name", ["smollm2", "qwen2", "spm"])
def test_special_tokens_have_no_bytes_and_the_rest_decode_as_the_tokenizer_does(tokenizers, name):
    tok = tokenizers[name]
    vocab = grammar_vocab(tok)
    assert len(vocab) == tok.vocab_size
    kinds = _kinds(tok)
    special = [i for i, k in enumerate(kinds) if k not in (NORMAL, BYTE)]
    assert special, "each test vocabulary has control or user-defined tokens"
    assert all(vocab[i] == b"" for i in special)
    text_ids = [i for i, k in enumerate(kinds) if k in (NORMAL, BYTE)]
    assert all(vocab[i] for i in text_ids), "a text token has no bytes"
    # Runs of normal tokens decode to the concatenation of their grammar bytes (what the grammar matched is
    # what the client receives). SentencePiece's decoder drops one leading space, so runs start with a
    # token that has none.
    runs = [text_ids[i:i + 7] for i in range(0, len(text_ids), 7)]
    checked = 0
    for run in runs:
        joined = b"".join(vocab[i] for i in run)
        if name == "spm" and joined.startswith(b" "):
            continue
        try:
            expected = joined.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a run ending inside a multi-byte character
        assert tok.decode(run) == expected, run
        checked += 1
    assert checked > len(runs) // 3


def test_named_special_tokens(tokenizers):
    smol, qwen, spm = tokenizers["smollm2"], tokenizers["qwen2"], tokenizers["spm"]
    for tok, texts in ((smol, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
                       (qwen, ["<think>", "</think>", "<|im_start|>"]),
                       (spm, ["[INST]", "<|tool|>", "<unk>", "<s>", "</s>"])):
        vocab = grammar_vocab(tok)
        for text in texts:
            assert vocab[tok._tokens.index(text)] == b"", text


def test_byte_fallback_tokens_are_their_byte(tokenizers):
    spm = tokenizers["spm"]
    vocab = grammar_vocab(spm)
    for i, token in enumerate(spm._tokens):
        if token.startswith("<0x") and len(token) == 6:
            assert vocab[i] == bytes([int(token[3:5], 16)])
    assert vocab[spm._tokens.index("\u2581the")] == b" the"


def test_padding_ids_past_the_vocabulary_are_empty(tokenizers):
    tok = tokenizers["qwen2"]
    vocab = grammar_vocab(tok, tok.vocab_size + 45)
    assert len(vocab) == tok.vocab_size + 45 and vocab[tok.vocab_size:] == [b""] * 45
    with pytest.raises(ValueError, match="smaller"):
        grammar_vocab(tok, tok.vocab_size - 1)


def test_stop_token_ids(tokenizers):
    smol = tokenizers["smollm2"]
    assert stop_token_ids(smol) == [0, 2]  # <|endoftext|> and <|im_end|> (the GGUF's EOS)
    assert tokenizers["spm"].eos_token_id in stop_token_ids(tokenizers["spm"])
