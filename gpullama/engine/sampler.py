"""Per-sequence sampling over a batch of logits: penalties and bias per row, then one `ops.sample` call for all."""

from __future__ import annotations

import torch

from gpullama.engine.sequence import Sequence
from gpullama.ops import TorchOps


def needs_penalties(seq: Sequence) -> bool:
    """Whether a sequence's logits must be changed before sampling."""
    p = seq.params
    return bool(p.logit_bias) or p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Logit bias, repetition penalty (prompt and output, as vLLM), presence and frequency penalties (output)."""
    p = seq.params
    device = logits.device
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=device)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_counts:
        ids = torch.tensor(list(seq.output_counts.keys()), dtype=torch.long, device=device)
        counts = torch.tensor(list(seq.output_counts.values()), dtype=logits.dtype, device=device)
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def sample_batch(logits: torch.Tensor, seqs: list[Sequence], ops: TorchOps) -> tuple[list[int], torch.Tensor | None]:
    """Pick the next token of each row (greedy, or drawn with the sequence's own generator after temperature,
    min-p, top-k and top-p); also return the rows' log-softmax when any sequence wants logprobs."""
    logprobs = None
    if any(s.params.logprobs is not None for s in seqs):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    penalised = [i for i, s in enumerate(seqs) if needs_penalties(s)]
    if penalised:
        logits = logits.float().clone()
        for i in penalised:
            apply_penalties(logits[i], seqs[i])
    device = logits.device
    params = [s.params for s in seqs]
    uniform = [float(torch.rand((), generator=s.generator)) if s.params.temperature > 0 else 0.0 for s in seqs]
    tokens = ops.sample(
        logits,
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([_top_k(p.top_k, logits.shape[-1]) for p in params], dtype=torch.int32, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        torch.tensor(uniform, dtype=torch.float32, device=device),
    )
    return tokens.tolist(), logprobs


def _top_k(top_k: int, vocab_size: int) -> int:
    """The sampler's top-k: 0 (off) for 0, -1, or any k that keeps the whole vocabulary, so any int fits int32."""
    return top_k if 0 < top_k < vocab_size else 0
