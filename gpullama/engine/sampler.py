"""Per-sequence sampling over a batch of logits: penalties, bias, temperature, top-k/top-p/min-p, logprobs."""

from __future__ import annotations

import torch

from gpullama.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Logit bias, repetition penalty (prompt and output, as vLLM), presence and frequency penalties (output)."""
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_counts:
        ids = torch.tensor(list(seq.output_counts.keys()), dtype=torch.long)
        counts = torch.tensor(list(seq.output_counts.values()), dtype=logits.dtype)
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def filter_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities after top-k, top-p (nucleus) and min-p filtering of temperature-scaled logits."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # keep each token whose preceding mass is below top_p (the first token is always kept)
        drop = (cumulative - sorted_probs) >= top_p * cumulative[-1]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample_batch(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
    """Pick the next token of each row; also return the rows' log-softmax when any sequence wants logprobs."""
    logprobs = None
    if any(s.params.logprobs is not None for s in seqs):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    plain = all(
        s.params.greedy and not s.params.logit_bias and s.params.repetition_penalty == 1.0
        and not s.params.presence_penalty and not s.params.frequency_penalty
        for s in seqs
    )
    if plain:
        return logits.argmax(dim=-1).tolist(), logprobs
    tokens = []
    for row, seq in zip(logits, seqs):
        p = seq.params
        row = apply_penalties(row.float().clone(), seq)
        if p.greedy:
            tokens.append(int(row.argmax()))
            continue
        probs = filter_probs(row / p.temperature, p.top_k, p.top_p, p.min_p)
        tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return tokens, logprobs
