"""Per-sequence sampling over a batch of logits: penalties and bias per row, then one `ops.sample` call for all."""

from __future__ import annotations

import torch

from gpullama.engine.sequence import Sequence
from gpullama.ops import TorchOps
from gpullama.ops.sampling import keep_mask


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
    min-p, top-k and top-p); also return the rows' log-probabilities when any sequence wants logprobs (the
    log-softmax, or for `processed_logprobs` the log of the distribution the row is drawn from)."""
    logprobs = None
    if any(s.params.logprobs is not None for s in seqs):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    penalised = [i for i, s in enumerate(seqs) if needs_penalties(s)]
    if penalised:
        logits = logits.float().clone()
        for i in penalised:
            apply_penalties(logits[i], seqs[i])
    for i, s in enumerate(seqs):
        if s.params.logprobs is not None and s.params.logprobs_mode == "processed_logprobs":
            logprobs[i] = torch.log(processed_probs(logits[i : i + 1], s.params))[0]
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


def verify_drafts(logits: torch.Tensor, drafts: list[int], seq: Sequence, ops: TorchOps
                  ) -> tuple[list[int], torch.Tensor | None]:
    """Check a sequence's draft tokens against the model and return the tokens it emits this step, with the rows'
    log-softmax when it wants logprobs.

    `logits` is ``[1 + len(drafts), V]``: row j is the model's next-token logits after its last token and the first
    j drafts. Greedy: each draft is kept while it equals the argmax of its row (the same `ops.sample` call plain
    decoding makes), then the first differing argmax (or, every draft kept, the last row's) follows: the output is
    exactly plain decoding's. Sampled: rejection sampling for a point-mass proposal (Leviathan et al., 2023; vLLM's
    rejection sampler): draft j is kept with probability p_j(draft) under the row's warped distribution
    (temperature, min-p, top-k, top-p), else a token is drawn from p_j without the draft, renormalised, and the
    step ends; every draft kept, a bonus token is drawn from the last row. Each emitted token is distributed
    exactly as plain sampling's. Sequences with penalties or logit bias never draft (`needs_penalties`)."""
    p = seq.params
    logprobs = None
    if p.logprobs is not None:
        logprobs = torch.log(processed_probs(logits, p)) if p.logprobs_mode == "processed_logprobs" else \
            torch.log_softmax(logits.float(), dim=-1)
    rows = logits.shape[0]
    device = logits.device
    if p.temperature <= 0:
        zero = torch.zeros(rows, dtype=torch.float32, device=device)
        targets = ops.sample(logits, zero, torch.zeros(rows, dtype=torch.int32, device=device), zero + 1, zero,
                             zero).tolist()
        tokens = []
        for draft, target in zip(drafts, targets):
            tokens.append(target)
            if target != draft:
                return tokens, logprobs
        tokens.append(targets[len(drafts)])
        return tokens, logprobs
    probs = warped_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
    tokens = []
    for j, draft in enumerate(drafts):
        if float(torch.rand((), generator=seq.generator)) < float(probs[j, draft]):
            tokens.append(draft)
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0
        tokens.append(_draw(residual, seq.generator))
        return tokens, logprobs
    tokens.append(_draw(probs[len(drafts)], seq.generator))
    return tokens, logprobs


def processed_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution a row is drawn from, ``[R, V]`` float32 (its bias and penalties already in `logits`):
    `warped_probs`, or for greedy decoding all of it on the argmax (llama.cpp's temperature 0)."""
    if params.temperature <= 0:
        x = logits.float()
        return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    return warped_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)


def warped_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The distribution `TorchOps.sample` draws from, per row ``[R, V]`` float32: softmax at `temperature`, cut by
    min-p, top-k and top-p (`keep_mask`), renormalised."""
    x = logits.float()
    rows, vocab = x.shape
    e = torch.exp((x - x.max(dim=-1, keepdim=True).values) / temperature)
    full = torch.ones(rows, dtype=torch.float32, device=x.device)
    keep = keep_mask(e, torch.full((rows,), _top_k(top_k, vocab), dtype=torch.int32, device=x.device),
                     full * top_p, full * min_p)
    kept = torch.where(keep, e, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a distribution ``[V]`` (not necessarily normalised) with one uniform draw."""
    cdf = probs.double().cumsum(0)
    target = float(torch.rand((), generator=generator)) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype, device=cdf.device), right=True))
    if index >= probs.shape[0] or probs[index] <= 0:  # rounding at the top: the last token with mass
        index = int(torch.nonzero(probs > 0)[-1])
    return index
