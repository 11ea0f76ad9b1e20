"""Reference helpers: bitmask bits with numpy, and decoding with random logits under a grammar."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from gpullama.structured import GrammarBackend, StructuredOutput

CLOSERS = {b'"', b"}", b"]", b",", b'"}', b"}]", b"]}", b"}}", b"!", b")"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def is_compact_json(text: str) -> bool:
    """Whether JSON text has no whitespace outside strings but the single space after each ',' and ':'."""
    bare = _STRING.sub('""', text)
    return not re.search(r"\s", bare.replace(", ", ",").replace(": ", ":"))


def greedy_tokens(vocab: list[bytes], text: bytes) -> list[int]:
    """Token ids spelling `text` (longest match first; a tokenization the grammar must accept like any other)."""
    by_bytes: dict[bytes, int] = {}
    for i, b in enumerate(vocab):
        if b:
            by_bytes.setdefault(b, i)
    longest = max(len(b) for b in by_bytes)
    out, pos = [], 0
    while pos < len(text):
        for n in range(min(longest, len(text) - pos), 0, -1):
            if text[pos:pos + n] in by_bytes:
                out.append(by_bytes[text[pos:pos + n]])
                pos += n
                break
        else:
            raise ValueError(f"no token spells {text[pos:pos + 1]!r}")
    return out


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in row `row`, read with numpy (little-endian int32 words: bit j of word w is
    token 32*w + j)."""
    bits = np.unpackbits(bitmask[row].numpy().astype("<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def allowed_matrix(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Bool (rows, vocab_size) reference of a whole bitmask."""
    bits = np.unpackbits(bitmask.numpy().astype("<i4").view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


@dataclass
class Walk:
    """One decode under a grammar: tokens (EOS excluded), their bytes, and whether the grammar terminated."""

    tokens: list[int]
    text: bytes
    terminated: bool
    steps: int


def _bonus(backend: GrammarBackend, token_bytes) -> torch.Tensor:
    key = (id(backend), backend.vocab_size)
    if key not in _BONUS:
        bonus = torch.zeros(backend.vocab_size)
        for i in range(backend.vocab_size):
            if i in backend.stop_token_ids:
                bonus[i] = 40.0
            elif token_bytes(i) in CLOSERS:
                bonus[i] = 20.0
        _BONUS[key] = bonus
    return _BONUS[key]


_BONUS: dict[tuple[int, int], torch.Tensor] = {}


def random_walk(backend: GrammarBackend, spec: StructuredOutput, token_bytes, seed: int, max_steps: int = 600,
                steer_after: int = 24) -> Walk:
    """Decode with random logits: mask them with the backend (fill + apply), sample, accept. After
    `steer_after` steps, closing tokens and EOS get a large bonus so that the walk ends."""
    gen = torch.Generator().manual_seed(seed)
    matcher = backend.matcher(backend.compile(spec))
    bitmask = backend.allocate_bitmask(1)
    size = backend.vocab_size
    bonus = _bonus(backend, token_bytes)
    tokens: list[int] = []
    for step in range(max_steps):
        backend.fill_bitmask([matcher], bitmask)
        allowed = allowed_matrix(bitmask, size)[0]
        assert allowed.any(), f"step {step}: no token allowed after {b''.join(map(token_bytes, tokens))!r}"
        logits = torch.randn(1, size, generator=gen) * 3
        if step >= steer_after:
            logits += bonus
        backend.apply_bitmask(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        assert allowed[token], f"sampled token {token} is not in the grammar's mask"
        assert matcher.accept_token(token), f"the matcher refused token {token}, which its mask allowed"
        if matcher.is_terminated():
            assert token in backend.stop_token_ids
            return Walk(tokens, b"".join(token_bytes(t) for t in tokens), True, step + 1)
        tokens.append(token)
    return Walk(tokens, b"".join(token_bytes(t) for t in tokens), False, max_steps)
