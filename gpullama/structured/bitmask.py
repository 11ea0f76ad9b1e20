"""Token bitmasks: one int32 row of ceil(vocab/32) words per batch row, bit j of word w allowing token 32*w + j."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

_ALL = -1  # int32 with every bit set


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row for a vocabulary (the logits width) of `vocab_size` tokens."""
    return (int(vocab_size) + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask of `batch_size` rows that allows every token (fill rows, then apply)."""
    return torch.full((batch_size, bitmask_width(vocab_size)), _ALL, dtype=torch.int32)


def allow_all(bitmask: torch.Tensor, row: int) -> None:
    """Let row `row` allow every token."""
    bitmask[row].fill_(_ALL)


def allow_only(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    """Let row `row` allow exactly `token_ids`."""
    words = [0] * bitmask.shape[-1]
    for t in token_ids:
        words[t >> 5] |= 1 << (t & 31)
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    bitmask[row] = torch.tensor(signed, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The rows of `bitmask` as a bool tensor (rows, vocab_size): True where the token is allowed."""
    if bitmask.shape[-1] * 32 < vocab_size:
        raise ValueError(f"a bitmask of {bitmask.shape[-1]} words covers {bitmask.shape[-1] * 32} tokens, "
                         f"fewer than {vocab_size}")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


def check_apply_args(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None) -> None:
    """ValueError unless `bitmask` can be applied to `logits` (2-D, int32, wide enough, rows given or equal)."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[-1] * 32 < logits.shape[-1]:
        # a kernel that trusts the mask would leave the columns past it unmasked; refuse instead.
        raise ValueError(f"bitmask of {bitmask.shape[-1]} words covers {bitmask.shape[-1] * 32} tokens but the "
                         f"logits have {logits.shape[-1]} columns: allocate it for the logits width")
    if rows is None and bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}; pass rows=")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set to -inf, in place, every logit whose bit is 0, in rows `rows` (default all) of both tensors.

    CPU logits take `apply_bitmask_cpu` (branch-free, several times faster), other devices `apply_bitmask_torch`.
    """
    if logits.device.type == "cpu" and bitmask.device.type == "cpu":
        apply_bitmask_cpu(logits, bitmask, rows)
    else:
        apply_bitmask_torch(logits, bitmask, rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """`apply_bitmask` in torch alone: any device and dtype (the bitmask is moved to the logits' device)."""
    check_apply_args(logits, bitmask, rows)
    if rows is not None and len(rows) == 0:
        return
    mask = bitmask if rows is None else bitmask[list(rows)]
    # inference mode: the engine's logits are inference tensors, which refuse in-place writes outside it
    with torch.inference_mode():
        allowed = bitmask_to_bool(mask.to(logits.device, non_blocking=True), logits.shape[-1])
        if rows is None:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """`apply_bitmask` for CPU logits (any float dtype): numpy's `unpackbits` of the inverted bitmask is the bool
    row of disallowed tokens as is, and `torch.where` writes -inf there without a branch per token."""
    check_apply_args(logits, bitmask, rows)
    if rows is not None and len(rows) == 0:
        return
    vocab = logits.shape[-1]
    words = bitmask.numpy().astype("<i4", copy=False)  # little-endian words (a no-op on x86 and ARM)
    if rows is not None:
        words = words[list(rows)]
    inverted = np.invert(np.ascontiguousarray(words).view(np.uint8))
    blocked = torch.from_numpy(np.unpackbits(inverted, axis=-1, count=vocab, bitorder="little").view(np.bool_))
    with torch.inference_mode():  # the engine's logits are inference tensors
        minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype)
        if rows is None:
            torch.where(blocked, minus_inf, logits, out=logits)
        else:
            for i, r in enumerate(rows):
                torch.where(blocked[i], minus_inf, logits[r], out=logits[r])
