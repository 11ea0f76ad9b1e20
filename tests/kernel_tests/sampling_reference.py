"""The test oracle of token sampling: the same filters and draw as the kernel, by sorting each row in float64."""

from __future__ import annotations

import torch


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Reference of `gpullama.kernels.sampling.sample` and `TorchOps.sample`, by sorting, in float64 (same filters, ties kept, same inverse-CDF draw)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for i, row in enumerate(logits.detach().double().cpu()):
        temp = float(temperature[i])
        if temp <= 0:
            out[i] = int(torch.argmax(row))
            continue
        e = torch.exp((row - row.max()) / temp)
        sorted_e, _ = torch.sort(e, descending=True)
        k = int(top_k[i])
        t_k = float(sorted_e[k - 1]) if 0 < k < e.numel() else 0.0
        floor = max(t_k, float(min_p[i]))
        t_p = 0.0
        if float(top_p[i]) < 1.0:
            kept = sorted_e[sorted_e >= floor]
            cumulative = torch.cumsum(kept, 0)
            n = int(torch.searchsorted(cumulative, float(top_p[i]) * float(kept.sum())))  # first prefix reaching p
            t_p = float(kept[min(n, kept.numel() - 1)])
        threshold = max(floor, t_p)
        kept_e = torch.where(e >= threshold, e, torch.zeros_like(e))
        cumulative = torch.cumsum(kept_e, 0)
        target = float(uniform[i]) * float(cumulative[-1])
        hits = torch.nonzero((cumulative > target) & (e >= threshold))
        out[i] = int(hits[0]) if hits.numel() else int(torch.nonzero(e >= threshold)[-1])
    return out
