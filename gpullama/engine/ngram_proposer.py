"""n-gram (prompt-lookup) drafting: propose the tokens that followed the latest earlier occurrence of a sequence's
last n tokens (as vLLM's ``ngram`` method and llama.cpp's prompt lookup); no draft model."""

from __future__ import annotations

import numpy as np

from gpullama.engine.args import SpeculativeConfig


class TokenBuffer:
    """A sequence's token ids as a growing numpy array, so a lookup does not convert the whole list each step."""

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)
        self.length = 0

    def view(self, token_ids: list[int]) -> np.ndarray:
        """The array of `token_ids` (which only ever grows at the end), updated with the ids added since."""
        n = len(token_ids)
        if n > self.array.shape[0]:
            grown = np.empty(max(n, 2 * self.array.shape[0]), dtype=np.int64)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length : n] = token_ids[self.length :]
        self.length = n
        return self.array[:n]


class NgramProposer:
    """Drafts for one sequence at a time from its own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def propose(self, ids: np.ndarray | list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens: for the longest n in [max_n .. min_n] whose last-n suffix occurred
        earlier in `ids`, the tokens after its latest earlier occurrence; [] when none matches."""
        k = min(self.k, limit)
        length = len(ids)
        if k <= 0 or length <= self.min_n:
            return []
        ids = np.asarray(ids, dtype=np.int64)
        # where an earlier occurrence could end: the positions before the last that hold the last token
        ends = np.flatnonzero(ids[:-1] == ids[-1])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            candidates = ends[ends >= n - 1]
            match = np.ones(candidates.shape[0], dtype=bool)
            for back in range(1, n):
                match &= ids[candidates - back] == ids[length - 1 - back]
            hits = candidates[match]
            if hits.size:
                start = int(hits[-1]) + 1
                return ids[start : start + k].tolist()
        return []
