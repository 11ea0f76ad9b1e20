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

    CPU logits in float32, float16 or float64 take `apply_bitmask_numpy` (one thread, no temporaries the size of
    the logits: it does not contend with the model's threads); everything else `apply_bitmask_torch`.
    """
    check_apply_args(logits, bitmask, rows)
    if rows is not None and len(rows) == 0:
        return
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and bitmask.device.type == "cpu" \
            and not logits.requires_grad:
        apply_bitmask_numpy(logits, bitmask, rows)
    else:
        apply_bitmask_torch(logits, bitmask, rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """`apply_bitmask` in torch: any device and dtype (the bitmask is moved to the logits' device)."""
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


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)
# _BLOCKED[b, j]: bit j of byte b is 0 (the token is disallowed). Bitmask words are little-endian int32, so byte k of
# a row holds tokens 8k..8k+7, lowest bit first.
_BLOCKED = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 0


def apply_bitmask_numpy(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """`apply_bitmask` for CPU logits in float32, float16 or float64, with numpy: each row's bytes expand to a
    bool row through a 256-entry table, and `np.copyto` writes -inf where it is set."""
    check_apply_args(logits, bitmask, rows)
    vocab = logits.shape[-1]
    with torch.inference_mode():
        out = logits.detach().numpy()  # shares memory with the logits
    words = bitmask.numpy().astype("<i4", copy=False)  # little-endian words (a no-op on x86 and ARM)
    for r in range(logits.shape[0]) if rows is None else rows:
        blocked = _BLOCKED[np.ascontiguousarray(words[r]).view(np.uint8)].reshape(-1)[:vocab]
        np.copyto(out[r], -np.inf, where=blocked)
