"""CPU weight formats of the fast path: each GGUF matrix repacked once at load for the kernels of
`gpullama.kernels.cpu_native` (the quantized types by its `gl_repack`), which dequantize it on the fly, exactly as
gguf's dequantizers do.

Each type keeps its own width and its own scale fields (issue 23), so the weights the kernels multiply by are
bit-identical to `gpullama.quants.dequantize`. The format (the units of 16 rows, each type's values, offset, scale,
zero and fields, its bytes a weight) is described once, at the top of `gpullama/kernels/cpu_native.c`.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from gpullama.kernels import cpu_native
from gpullama.quants import QTensor, concat_rows

Q = gguf.GGMLQuantizationType

_CHUNK_ROWS = 4096  # rows of a float matrix converted at a time, to bound the memory a load needs
_ROW_ALIGN = 16

NATIVE_FORMATS = {
    Q.Q4_0: cpu_native.FMT_Q4_0, Q.Q4_1: cpu_native.FMT_Q4_1, Q.Q5_0: cpu_native.FMT_Q5_0,
    Q.Q5_1: cpu_native.FMT_Q5_1, Q.Q8_0: cpu_native.FMT_Q8_0, Q.Q4_K: cpu_native.FMT_Q4_K,
    Q.Q5_K: cpu_native.FMT_Q5_K, Q.Q6_K: cpu_native.FMT_Q6_K, Q.MXFP4: cpu_native.FMT_MXFP4,
}
"""Types held at their own width, with their own scale fields, each in its `cpu_native` format."""
QUANTIZED_TYPES = tuple(NATIVE_FORMATS)
"""Every quantized type with a CPU format."""
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
"""Types whose blocks cover 256 values: their rows must be a multiple of 256 values."""


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """Per-row data ``[n, groups, a, b]`` (n a multiple of 16) as ``[n / 16, groups, a * 16 * b * itemsize]``
    bytes: item a of every row of 16, then item a + 1."""
    n, groups = t.shape[:2]
    t = t.reshape(n // 16, 16, groups, t.shape[2], -1).permute(0, 2, 3, 1, 4).contiguous()
    return t.view(torch.uint8).reshape(n // 16, groups, -1)


@dataclass
class CpuWeight:
    """One matrix in a `cpu_native` weight format; `matmul` computes ``x @ W.T``."""

    fmt: int  # cpu_native.FMT_*
    blocks: torch.Tensor  # uint8 [N padded to 16 / 16, units, unit bytes]
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.blocks.nbytes

    @classmethod
    def from_qtensor(cls, weight: QTensor) -> CpuWeight:
        """Repack a 2-D GGUF matrix (see `packable`): the quantized types in C by torch's threads
        (`cpu_native.repack`), the float ones a few thousand rows at a time."""
        n, k = weight.shape
        qtype = weight.qtype
        if qtype in NATIVE_FORMATS:
            return cls.from_parts([weight])
        chunks = []
        for start in range(0, n, _CHUNK_ROWS):
            values = weight.data[start : start + _CHUNK_ROWS]
            values = values if qtype == Q.F16 else values.to(torch.float32)
            pad = -values.shape[0] % _ROW_ALIGN  # only the last chunk can be short; zero rows compute 0
            values = torch.cat([values, values.new_zeros(pad, k)])
            chunks.append(_interleave(values.reshape(-1, k // 32, 32, 1)))  # value k of the 16 rows, then k + 1
        return cls(cpu_native.FMT_F16 if qtype == Q.F16 else cpu_native.FMT_F32, torch.cat(chunks), n, k)

    @classmethod
    def from_parts(cls, parts: list[QTensor]) -> CpuWeight:
        """Quantized 2-D matrices of one type and row width (see `packable`; q|k|v, gate|up) as one matrix of their
        rows in order, repacked in C from where they lie, without a joined copy."""
        k = parts[0].shape[1]
        fmt = NATIVE_FORMATS[parts[0].qtype]
        return cls(fmt, cpu_native.repack(fmt, [p.data for p in parts], k), sum(p.shape[0] for p in parts), k)

    def matmul(self, x: torch.Tensor, bits: int = 16) -> torch.Tensor:
        """``x [M, K] @ W.T``: float32 ``[M, N]`` (a column slice of a wider result where N was padded); `bits`:
        the activations' integers for a quantized format (`cpu_native.matmul`)."""
        out = x.new_empty(x.shape[0], 16 * self.blocks.shape[0])
        cpu_native.matmul(self.fmt, x, self.blocks, out, bits)
        return out if out.shape[1] == self.out_features else out[:, : self.out_features]


def _has_format(qtype: gguf.GGMLQuantizationType, cols: int) -> bool:
    return qtype in QUANTIZED_TYPES + (Q.F16, Q.BF16, Q.F32) and cols % (256 if qtype in K_QUANTS else 32) == 0


def packable(weight: QTensor) -> bool:
    """Whether `weight` has a CPU format: a 2-D matrix of a supported type whose rows are whole blocks (32 values,
    256 for the K-quants)."""
    return len(weight.shape) == 2 and _has_format(weight.qtype, weight.shape[1])


@dataclass
class CpuExperts:
    """A MoE layer's E expert matrices of one kind (gate|up, or down) in one `cpu_native` format, stacked:
    ``blocks [E, N padded to 16 / 16, units, unit bytes]``, as `cpu_native.moe` reads them."""

    fmt: int
    blocks: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.blocks.nbytes

    @property
    def operand(self) -> tuple[int, torch.Tensor]:
        """(fmt, blocks), as `cpu_native.moe` takes them."""
        return self.fmt, self.blocks

    @classmethod
    def from_qtensors(cls, parts: list[QTensor]) -> CpuExperts:
        """Pack stacked experts ``[E, rows, K]`` (the parts' rows of each expert joined: gate then up), one expert
        at a time."""
        num_experts = parts[0].shape[0]

        def expert(e: int) -> CpuWeight:
            rows = [QTensor(p.data[e], p.qtype, p.shape[1:], p.name) for p in parts]
            if parts[0].qtype in NATIVE_FORMATS:
                return CpuWeight.from_parts(rows)
            return CpuWeight.from_qtensor(rows[0] if len(rows) == 1 else concat_rows(rows))

        first = expert(0)  # one layer's experts into one buffer (no second copy at load)
        blocks = first.blocks.new_empty((num_experts, *first.blocks.shape))
        blocks[0] = first.blocks
        for e in range(1, num_experts):
            blocks[e] = expert(e).blocks
        return cls(first.fmt, blocks)


def packable_experts(parts: list[QTensor]) -> bool:
    """Whether stacked experts have a CPU format: one type, a quantized one or F16/BF16/F32, rows of whole
    blocks."""
    first = parts[0]
    return all(len(p.shape) == 3 and p.qtype == first.qtype and p.shape[2] == first.shape[2] for p in parts) and (
        _has_format(first.qtype, first.shape[2])
    )
