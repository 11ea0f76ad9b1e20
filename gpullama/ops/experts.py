"""Mixture-of-experts in plain torch: routing, the experts' activations, and the `Experts` a backend prepares.

A MoE layer routes each token ``t`` to ``k`` of ``E`` experts (`route`: ids ``[T, k]`` and weights ``[T, k]``);
expert ``e`` is a gated MLP with its own gate|up matrix ``[2I, H]`` (gate rows first, then up), optional biases,
and down matrix ``[H, I]``; the layer's output row is ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``, the
terms added in slot order j = 0 .. k-1 (the same order alone or batched).

The torch reference (`TorchOps.moe`) runs each active expert over its rows in expert order, as transformers does;
the CPU fast path (`CpuOps`) and the Triton kernel (`gpullama.kernels.fused_moe`) compute the same sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class Experts:
    """One MoE layer's experts in an ops backend's weight format (what `ops.moe` reads)."""

    gate_up: Any  # the backend's form of the E stacked [2I, H] gate|up matrices
    down: Any  # the backend's form of the E stacked [H, I] down matrices
    gate_up_bias: torch.Tensor | None  # [E, 2I] float32 (gpt-oss), or None
    down_bias: torch.Tensor | None  # [E, H] float32 (gpt-oss), or None
    num_experts: int
    intermediate_size: int  # I: rows of one expert's gate (and of its up)
    hidden_size: int  # H
    activation: str = "silu"  # "silu", "swiglu_oai" or "gelu_tanh" (see `activate`)
    alpha: float = 1.702  # swiglu_oai's sigmoid slope
    limit: float = 7.0  # swiglu_oai's clamp

    @property
    def nbytes(self) -> int:
        """Bytes the expert weights take in this backend's format."""
        return sum(_nbytes(t) for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias))


def _nbytes(t: Any) -> int:
    if t is None:
        return 0
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return int(t.nbytes)


def route(
    logits: torch.Tensor, k: int, gating: str = "softmax", norm: bool = False, scale: float = 1.0,
    bias: torch.Tensor | None = None, groups: int = 1, groups_used: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[T, k]`` int64 and their weights ``[T, k]`` float32 from router logits ``[T, E]``, each row on its
    own, as llama.cpp's `build_moe_ffn` computes them: "softmax" takes the top k of the softmax over all experts,
    "sigmoid" of the sigmoids (GLM-4.5, DeepSeek-V3), both renormalized to sum 1 with `norm` (qwen3moe, Mixtral);
    "softmax_topk" the softmax of the top k logits (gpt-oss); then times `scale`. `bias` ``[E]`` (``exp_probs_b``)
    is added to the probabilities for the choice only; with `groups` > 1 the choice is limited to the
    `groups_used` groups (of E / groups consecutive experts) whose two best biased probabilities sum highest."""
    logits = logits.float()
    if gating == "softmax_topk":
        top, ids = logits.topk(k, dim=-1)
        weights = top.softmax(dim=-1)
    else:
        probs = logits.sigmoid() if gating == "sigmoid" else logits.softmax(dim=-1)
        if bias is None and groups == 1:
            weights, ids = probs.topk(k, dim=-1)
        else:
            choice = probs if bias is None else probs + bias
            if groups > 1:
                grouped = choice.view(choice.shape[0], groups, -1)
                best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(groups_used, dim=-1).indices
                keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=logits.device).scatter_(1, best, True)
                choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
            ids = choice.topk(k, dim=-1).indices
            weights = probs.gather(1, ids)
        if norm:  # llama.cpp clamps the sum at float16's smallest normal
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=6.103515625e-5)
    if scale != 1.0:
        weights = weights * scale
    return ids, weights


def activate(gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``[M, 2I]`` gate|up -> ``[M, I]``: "silu" is ``silu(gate) * up``; "swiglu_oai" (gpt-oss) is ``g *
    sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up.clamp(-limit, limit) + 1)
    return F.silu(gate) * up


def expert_rows(ids: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each expert that some token uses, in expert order: (expert, tokens, slots) of its (token, slot) pairs,
    in token order."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    k = ids.shape[1]
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start : start + n]
            out.append((e, pairs // k, pairs % k))
            start += n
    return out
