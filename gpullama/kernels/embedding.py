"""Embedding lookup that dequantizes only the gathered rows, straight from GGUF blocks.

Grid ``(T, cdiv(H, BLOCK))``: each program reads the id of its token and dequantizes BLOCK values of that row
with `gguf_blocks.dequantize_tile` (a ``[1, BLOCK / SUB, SUB]`` tile), writing float32 ``[T, H]`` times `scale`
(Gemma's sqrt(hidden), Granite's embedding multiplier; 1 elsewhere).
Torch reference: `TorchOps.embedding` (``take_rows`` then `dequantize`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpullama.kernels.gguf_blocks import dequantize_tile, sub_block_size
from gpullama.kernels.quant_matmul import _operands
from gpullama.quants import QTensor


@triton.jit
def _embedding_kernel(
    ids_ptr, w_ptr, h_ptr, out_ptr, H, row_stride, scale, FMT: tl.constexpr, SUB: tl.constexpr, BLOCK: tl.constexpr
):
    """BLOCK float32 values of the embedding row of one token."""
    t = tl.program_id(0).to(tl.int64)
    sub = (tl.program_id(1) * BLOCK) // SUB + tl.arange(0, BLOCK // SUB)[None, :, None]
    lane = tl.arange(0, SUB)[None, None, :]
    row = tl.zeros([1, 1, 1], tl.int64) + tl.load(ids_ptr + t).to(tl.int64)
    values = dequantize_tile(w_ptr, h_ptr, row, sub, lane, row_stride, row >= 0, H, FMT, SUB)
    cols = sub * SUB + lane
    tl.store(out_ptr + t * H + cols, values * scale, mask=cols < H)


def embedding(ids: torch.Tensor, table: QTensor | torch.Tensor, block: int = 1024, scale: float = 1.0) -> torch.Tensor:
    """Rows `ids` of the table, dequantized to float32 ``[T, H]``, times `scale`."""
    data, halves, row_stride, fmt, vocab, hidden = _operands(table)
    if block % 32:
        raise ValueError(f"embedding: block must be a multiple of 32 (the sub-block), got {block}")
    if ids.dim() != 1:
        raise ValueError(f"embedding: ids must be a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"embedding: token id out of range [0, {vocab}) (got {int(ids.min())}..{int(ids.max())})")
    out = torch.empty((ids.shape[0], hidden), device=data.device, dtype=torch.float32)
    if ids.shape[0]:
        grid = (ids.shape[0], triton.cdiv(hidden, block))
        _embedding_kernel[grid](ids.contiguous(), data, halves, out, hidden, row_stride, float(scale), FMT=fmt,
                                SUB=sub_block_size(fmt), BLOCK=block)
    return out
