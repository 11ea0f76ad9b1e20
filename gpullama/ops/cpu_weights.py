"""CPU weight formats of the fast path: each GGUF matrix repacked once at load for the kernels of
`gpullama.kernels.cpu_native`, which dequantize it on the fly, exactly as gguf's dequantizers do.

Each type keeps its own width and its own scale fields (issue 23), so the weights the kernels multiply by are
bit-identical to `gpullama.quants.dequantize`. The format (the units of 16 rows, each type's values, offset, scale,
zero and fields, its bytes a weight) is described once, at the top of `gpullama/kernels/cpu_native.c`; this module
writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from gpullama.kernels import cpu_native
from gpullama.quants import QTensor, _bits, _nibbles, _q5_quants, unpack_k_scales

Q = gguf.GGMLQuantizationType

_CHUNK_ROWS = 4096  # rows converted at a time, to bound the memory a load needs
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
_BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.MXFP4: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 6, Q.Q8_0: 8}


def native_fields(data: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """GGUF rows ``[n, row bytes]`` of a type of `NATIVE_FORMATS` as (values ``[n, K / 32, 32]`` uint8: the
    unsigned quants, Q8_0's signed bytes as they are; the type's scale fields per unit of 32 values, 256 for the
    K-quants: ``[n, units, count]`` each, float16 as in the file, Q4_K/Q5_K's 6-bit sc and mn as bytes, MXFP4's
    E8M0 byte))."""
    n = data.shape[0]
    b = data.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])

    def half(at: int) -> torch.Tensor:
        return b[:, at : at + 2].contiguous().view(torch.float16).reshape(n, -1, 1)

    if qtype == Q.Q6_K:
        low = _nibbles(b[:, 0:128].reshape(-1, 2, 64))
        high = _bits(b[:, 128:192].reshape(-1, 2, 32), 2, 4).reshape(-1, 2, 128)
        values, fields = low | (high << 4), [b[:, 192:208].reshape(n, -1, 16), half(208)]
    elif qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = unpack_k_scales(b[:, 4:16])
        values = _nibbles(b[:, -128:].reshape(-1, 4, 32)).reshape(-1, 256)
        if qtype == Q.Q5_K:
            values = values | (_bits(b[:, 16:48], 1, 8).reshape(-1, 256) << 4)
        fields = [sc.reshape(n, -1, 8), mn.reshape(n, -1, 8), half(0), half(2)]
    elif qtype == Q.Q8_0:
        values, fields = b[:, 2:], [half(0)]
    elif qtype == Q.MXFP4:  # the E2M1 codes as they are (the kernel looks them up), the exponent byte
        values, fields = _nibbles(b[:, 1:]), [b[:, 0:1].reshape(n, -1, 1)]
    elif qtype == Q.Q4_0:
        values, fields = _nibbles(b[:, 2:]), [half(0)]
    elif qtype == Q.Q4_1:
        values, fields = _nibbles(b[:, 4:]), [half(0), half(2)]
    elif qtype == Q.Q5_0:
        values, fields = _q5_quants(b[:, 2:6], b[:, 6:]), [half(0)]
    else:  # Q5_1
        values, fields = _q5_quants(b[:, 4:8], b[:, 8:]), [half(0), half(2)]
    return values.reshape(n, -1, 32), fields


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """Per-row data ``[n, groups, a, b]`` (n a multiple of 16) as ``[n / 16, groups, a * 16 * b * itemsize]``
    bytes: item a of every row of 16, then item a + 1."""
    n, groups = t.shape[:2]
    t = t.reshape(n // 16, 16, groups, t.shape[2], -1).permute(0, 2, 3, 1, 4).contiguous()
    return t.view(torch.uint8).reshape(n // 16, groups, -1)


def _bit_planes(values: torch.Tensor, planes: int) -> torch.Tensor:
    """Bits 4 .. 3 + planes of `values` ``[n, groups, 32]`` as the kernels' words ``[n / 16, groups, 64 planes]``:
    word ((2j + h) * planes + p) * 2 + r holds, at bit 4 rl + i, bit 4 + p of value 16h + 4j + i of row 8r + rl."""
    n, groups = values.shape[:2]
    bits = torch.stack([(values >> (4 + p)) & 1 for p in range(planes)], dim=-1)  # [n, groups, 32, planes]
    bits = bits.reshape(n // 16, 2, 8, groups, 2, 4, 4, planes).permute(0, 3, 5, 4, 7, 1, 2, 6)
    bits = bits.reshape(n // 16, groups, 16 * planes, 4, 8)  # bit 4 rl + i: bit i + 4 (rl % 2) of byte rl // 2
    words = torch.zeros(bits.shape[:-1], dtype=torch.uint8)
    for k in range(8):
        words |= bits[..., k] << k
    return words.reshape(n // 16, groups, -1)


def _native_blocks(data: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """GGUF rows ``[n, row bytes]`` (n a multiple of 16) as the blocks of `cpu_native`'s format for `qtype`."""
    values, fields = native_fields(data, qtype)
    n, groups = values.shape[:2]
    if _BITS[qtype] == 8:
        sections = [_interleave(values.reshape(n, groups, 8, 4))]
    else:  # byte j: value j in its low nibble, value j + 16 in its high nibble; then the bit planes
        nibbles = (values[..., :16] & 15) | ((values[..., 16:] & 15) << 4)
        sections = [_interleave(nibbles.reshape(n, groups, 4, 4))]
        if _BITS[qtype] > 4:
            sections.append(_bit_planes(values, _BITS[qtype] - 4))
    units = fields[0].shape[1]
    value_bytes = torch.cat(sections, dim=-1).reshape(n // 16, units, -1)  # K-quants: 8 groups of 32 a unit
    return torch.cat([value_bytes] + [_interleave(f.unsqueeze(-1)) for f in fields], dim=-1)


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
        """Repack a 2-D GGUF matrix (see `packable`), a few thousand rows at a time."""
        n, k = weight.shape
        qtype = weight.qtype
        chunks = []
        for start in range(0, n, _CHUNK_ROWS):
            data = weight.data[start : start + _CHUNK_ROWS]
            pad = -data.shape[0] % _ROW_ALIGN  # only the last chunk can be short; zero rows compute 0
            if qtype in NATIVE_FORMATS:  # rows of zero bytes: blocks whose scales are 0
                chunks.append(_native_blocks(torch.cat([data, data.new_zeros(pad, data.shape[1])]), qtype))
                continue
            values = data if qtype == Q.F16 else data.to(torch.float32)
            values = torch.cat([values, values.new_zeros(pad, k)])
            chunks.append(_interleave(values.reshape(-1, k // 32, 32, 1)))  # value k of the 16 rows, then k + 1
        fmt = NATIVE_FORMATS.get(qtype, cpu_native.FMT_F16 if qtype == Q.F16 else cpu_native.FMT_F32)
        return cls(fmt, torch.cat(chunks), n, k)

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

        def expert(e: int) -> QTensor:
            data = [p.data[e] for p in parts]
            rows = sum(p.shape[1] for p in parts)
            joined = data[0] if len(data) == 1 else torch.cat(data, dim=0)
            return QTensor(joined, parts[0].qtype, (rows, parts[0].shape[2]), parts[0].name)

        first = CpuWeight.from_qtensor(expert(0))  # one layer's experts into one buffer (no second copy at load)
        blocks = first.blocks.new_empty((num_experts, *first.blocks.shape))
        blocks[0] = first.blocks
        for e in range(1, num_experts):
            blocks[e] = CpuWeight.from_qtensor(expert(e)).blocks
        return cls(first.fmt, blocks)


def packable_experts(parts: list[QTensor]) -> bool:
    """Whether stacked experts have a CPU format: one type, a quantized one or F16/BF16/F32, rows of whole
    blocks."""
    first = parts[0]
    return all(len(p.shape) == 3 and p.qtype == first.qtype and p.shape[2] == first.shape[2] for p in parts) and (
        _has_format(first.qtype, first.shape[2])
    )
