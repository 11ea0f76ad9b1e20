"""The sampling filters in torch: which tokens a row keeps under min-p, top-k and top-p (`keep_mask`), shared by
`TorchOps.sample` and the engine's sampler."""

from __future__ import annotations

import torch

NUCLEUS_CANDIDATES = 256  # largest values taken for top-p before falling back to a full sort


def keep_mask(e: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Which tokens each row keeps, in vLLM's order: min-p, top-k, then the top-p nucleus of what is left.

    `e` is ``[B, V]`` probabilities over the row's largest one (so the top token has e == 1); top_k <= 0 or >= V,
    top_p >= 1 and min_p <= 0 turn that filter off; ties at a threshold are all kept.
    """
    v = e.shape[-1]
    k = top_k.long()
    k_on, p_on = (k > 0) & (k < v), top_p < 1
    k_max = int(k[k_on].max()) if bool(k_on.any()) else 0
    nucleus = bool(p_on.any())
    # the k-th largest value, and for top-p the largest values in order: a partial sort (topk) of as many as the
    # step needs; the whole vocabulary is sorted only for a nucleus that the first candidates do not hold
    width = min(v, max(k_max, NUCLEUS_CANDIDATES if nucleus else 0))
    largest = e.topk(width, dim=-1).values if width else None
    t_k = torch.zeros_like(e[:, 0])
    if k_max:
        t_k = torch.where(k_on, largest.gather(1, (k.clamp(1, k_max) - 1)[:, None])[:, 0], t_k)
    floor = torch.maximum(t_k, min_p.to(e.dtype))
    if not nucleus:
        return e >= floor[:, None]
    total = torch.where(e >= floor[:, None], e, 0.0).sum(-1, dtype=torch.float64).to(e.dtype)
    target = top_p.to(e.dtype) * total

    def first_reaching(ordered: torch.Tensor) -> torch.Tensor:
        """How many of the row's largest kept values have a running sum below the target."""
        return (torch.where(ordered >= floor[:, None], ordered, 0.0).cumsum(-1) < target[:, None]).sum(-1)

    first = first_reaching(largest)
    if width < v and bool((first[p_on] >= width).any()):
        largest = e.sort(dim=-1, descending=True).values
        first = first_reaching(largest)
    t_p = largest.gather(1, first.clamp(max=largest.shape[-1] - 1)[:, None])[:, 0]
    t_p = torch.where(p_on, t_p, torch.zeros_like(floor))
    return e >= torch.maximum(floor, t_p)[:, None]
