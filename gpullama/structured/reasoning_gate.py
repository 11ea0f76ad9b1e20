"""A matcher that lets a reasoning block (``<think>...</think>``, or a chat format's own tags) through unconstrained,
then applies its grammar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpullama.structured.backend import GrammarMatcher
from gpullama.structured.bitmask import allow_all, allow_only

if TYPE_CHECKING:
    from gpullama.tokenizer import Tokenizer

_MAYBE, _THINK, _ANSWER, _DONE = "maybe", "think", "answer", "done"


def reasoning_token_ids(tokenizer: Tokenizer, open_tag: str = "<think>",
                        close_tag: str = "</think>") -> tuple[int, int] | None:
    """(open id, close id) of a reasoning block's tags, else None: the closing tag must be a single token of the
    vocabulary; the opening one a single token too or, where it is longer, begin with a special token that then
    opens the block (Gemma 4's ``<|channel>thought`` opens with ``<|channel>``, which the model writes only there)."""
    prefixes = {open_tag[:k].encode(): k for k in range(1, len(open_tag) + 1)}
    found: dict[bytes, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        spelled = tokenizer.token_bytes(i)
        if spelled in prefixes or spelled == close_tag.encode():
            found.setdefault(spelled, []).append(i)
    close = found.get(close_tag.encode(), [])
    if len(close) != 1:
        return None
    whole = found.get(open_tag.encode(), [])
    if len(whole) == 1:
        return whole[0], close[0]
    special = tokenizer.special_token_ids
    for k in range(len(open_tag) - 1, 0, -1):
        opener = [i for i in found.get(open_tag[:k].encode(), ()) if i in special]
        if len(opener) == 1:
            return opener[0], close[0]
    return None


class ReasoningGatedMatcher(GrammarMatcher):
    """Wraps a grammar matcher: tokens up to and including the close-tag token are free, the rest follow the
    grammar. With `start_in_reasoning` the output starts inside the block (the prompt opened it); otherwise it
    may start with the open-tag token (the first mask is the grammar's plus that token), or go straight to the
    grammar. An EOS inside the reasoning ends the sequence (`is_terminated`)."""

    def __init__(self, inner: GrammarMatcher, open_id: int, close_id: int, stop_token_ids: Sequence[int],
                 start_in_reasoning: bool = False) -> None:
        self.inner = inner
        self.open_id, self.close_id = int(open_id), int(close_id)
        self._stop = frozenset(stop_token_ids)
        self._initial = _THINK if start_in_reasoning else _MAYBE
        self._state = self._initial
        self._history: list[tuple[str, bool]] = []  # per accepted token: state before it, went to the grammar

    @property
    def in_reasoning(self) -> bool:
        """Whether the next token is still free (inside the reasoning block)."""
        return self._state == _THINK

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Every token inside the reasoning; the grammar's tokens after it (plus the open tag at the start)."""
        if self._state == _THINK:
            allow_all(bitmask, row)
            return
        if self._state == _DONE:
            allow_only(bitmask, row, sorted(self._stop))
            return
        self.inner.fill_bitmask(bitmask, row)
        if self._state == _MAYBE:
            word, bit = self.open_id >> 5, self.open_id & 31
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token (free inside the reasoning); False if the grammar refuses it."""
        token_id, before = int(token_id), self._state
        if before == _DONE:
            return False
        if before == _MAYBE and token_id == self.open_id:
            self._state = _THINK
        elif before == _THINK:
            if token_id == self.close_id:
                self._state = _ANSWER
            elif token_id in self._stop:
                self._state = _DONE
        else:
            if not self.inner.accept_token(token_id):
                return False
            self._state = _ANSWER
            self._history.append((before, True))
            return True
        self._history.append((before, False))
        return True

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens (the grammar's share goes to the inner matcher)."""
        if num_tokens <= 0:
            return
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens, {len(self._history)} accepted")
        undone = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        to_inner = sum(1 for _, inner in undone if inner)
        if to_inner:
            self.inner.rollback(to_inner)
        self._state = undone[0][0]

    def is_terminated(self) -> bool:
        """Whether the grammar ended with an accepted EOS, or an EOS ended the reasoning."""
        return self._state == _DONE or (self._state == _ANSWER and self.inner.is_terminated())

    def reset(self) -> None:
        """Back to the start, before the reasoning."""
        self.inner.reset()
        self._state, self._history = self._initial, []
