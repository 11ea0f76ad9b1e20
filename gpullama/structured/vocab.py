"""The vocabulary as a grammar engine sees it: each token id's raw bytes, and the ids that end a sequence."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpullama.tokenizer import BYTE, NORMAL

if TYPE_CHECKING:
    from gpullama.tokenizer import Tokenizer

# Token kinds whose text is what the token decodes to. Control, user-defined, unknown and unused tokens get no
# bytes: a grammar then never allows them (not inside a JSON string either, where `<|im_start|>` would be text).
_TEXT_KINDS = (NORMAL, BYTE)


def token_kinds(tokenizer: Tokenizer) -> list[int]:
    """GGUF token type of each vocabulary entry (control/user-defined from `special_token_ids` if unknown)."""
    kinds = getattr(tokenizer, "_types", None)
    if kinds is not None and len(kinds) == tokenizer.vocab_size:
        return list(kinds)
    special = tokenizer.special_token_ids
    return [0 if i in special else NORMAL for i in range(tokenizer.vocab_size)]


def grammar_vocab(tokenizer: Tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """Raw bytes of each token id in ``range(vocab_size)`` (default: the tokenizer's size); empty for special,
    unused and padding ids (ids at or past the tokenizer's vocabulary, when the model's logits are wider)."""
    n = tokenizer.vocab_size
    size = n if vocab_size is None else int(vocab_size)
    if size < n:
        raise ValueError(f"vocab_size {size} is smaller than the tokenizer's {n} tokens")
    kinds = token_kinds(tokenizer)
    out = [tokenizer.token_bytes(i) if kinds[i] in _TEXT_KINDS else b"" for i in range(n)]
    out.extend(b"" for _ in range(size - n))
    return out


def stop_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids that end generation (EOS and the other end-of-generation tokens), sorted."""
    ids = set(tokenizer.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the tokenizer has no end-of-sequence token; a grammar could never end")
    return sorted(ids)
