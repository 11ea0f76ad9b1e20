"""n-gram (prompt-lookup) drafting: propose the tokens that followed the latest earlier occurrence of a sequence's
last n tokens (as vLLM's ``ngram`` method and llama.cpp's prompt lookup); no draft model."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gpullama.engine.args import SpeculativeConfig


class NgramProposer:
    """Drafts for one sequence at a time from its own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens: for the longest n in [max_n .. min_n] whose last-n suffix occurred
        earlier in `token_ids`, the tokens after its latest earlier occurrence; [] when none matches."""
        k = min(self.k, limit)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows start at 0 .. length - n - 1: every occurrence before the suffix itself
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []
