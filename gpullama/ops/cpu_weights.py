"""CPU weight formats of the fast path: each GGUF matrix repacked once at load for the kernels of
`gpullama.kernels.cpu_native`, which dequantize it on the fly, exactly as gguf's dequantizers do.

Every quantized type is ``w = q * scale + zero`` per group of values with a small integer ``q``; the kernels
compute that with one fused multiply-add, which rounds once, as gguf's float32 dequantizers do (their ``d * q``
is exact in float32 for every type), so the weights the kernels multiply by are bit-identical to
`gpullama.quants.dequantize`. Per type (``d``, ``m``, ``sc``, ``mn`` the block's fields as in `gpullama.quants`;
``dl = d * sc``, ``ml = dmin * mn`` per sub-block):

| GGUF type | format | q | scale | zero | group | bytes/weight (GGUF) |
| --- | --- | --- | --- | --- | ---: | --- |
| Q4_0 | Q4 | q (0..15) | d | -8d | 32 | 0.625 (0.5625) |
| Q4_1 | Q4 | q | d | m | 32 | 0.625 (0.625) |
| Q4_K | Q4 | q | dl | -ml | 32 | 0.75 (0.5625) |
| Q5_0 | Q8 | q (0..31) | d | -16d | 32 | 1.125 (0.6875) |
| Q5_1 | Q8 | q (0..31) | d | m | 32 | 1.125 (0.75) |
| Q5_K | Q8 | q (0..31) | dl | -ml | 32 | 1.25 (0.6875) |
| Q8_0 | Q8 | q + 128 | d | -128d | 32 | 1.125 (1.0625) |
| Q6_K | Q8 | q (0..63) | d * scale | -32 d * scale | 16 | 1.5 (0.8203) |
| MXFP4 | Q8 | E2M1 value x 2 + 12 (0..24) | e8m0 / 2 | -12 e8m0 / 2 | 32 | 1.125 (0.53125) |
| F16 | F16 | | | | | 2 |
| BF16, F32 | F32 (exact) | | | | | 4 |

MXFP4's scale is a power of two and its values small integers, so ``q * scale + zero`` is exact too.

Scales and zeros are float16 for the types whose fields are float16 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; float32
where ``-8d`` and the like overflow float16), float32 for the K-quants.

Q4 packs 32 values in 16 bytes (low nibble value k, high nibble value k + 16); Q8 holds one unsigned byte a value.
The kernels read rows 16 at a time: each 16 rows are stored as one stream of blocks of 32 values (see the top of
`cpu_native.c`); rows are padded with zeros to a multiple of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from gpullama.kernels import cpu_native
from gpullama.quants import MXFP4_VALUES, QTensor, _bits, _f16, _nibbles, _q5_quants, e8m0_half, unpack_k_scales

Q = gguf.GGMLQuantizationType

_CHUNK_ROWS = 4096  # rows converted at a time, to bound the memory a load needs
_ROW_ALIGN = 16

Q4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
"""Types packed as 4-bit values."""
Q8_TYPES = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q8_0, Q.Q6_K, Q.MXFP4)
"""Types packed as 8-bit values."""
HALF_SCALE_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
"""Types whose scales and zeros are float16 values (``-8d`` included), kept as float16."""


def _legacy(b: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> tuple[torch.Tensor, ...]:
    """u, scale, zero of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks ``[n, type_size]`` (one scale per 32 values)."""
    d = _f16(b[:, 0:2])[:, 0]
    if qtype == Q.Q8_0:
        return (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8), d, -128 * d
    if qtype == Q.Q4_0:
        return _nibbles(b[:, 2:]), d, -8 * d
    if qtype == Q.Q4_1:
        return _nibbles(b[:, 4:]), d, _f16(b[:, 2:4])[:, 0]
    if qtype == Q.Q5_0:
        return _q5_quants(b[:, 2:6], b[:, 6:]), d, -16 * d
    return _q5_quants(b[:, 4:8], b[:, 8:]), d, _f16(b[:, 2:4])[:, 0]  # Q5_1


def _k_quant(b: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> tuple[torch.Tensor, ...]:
    """u, scale, zero of Q4_K/Q5_K/Q6_K super-blocks ``[n, type_size]``."""
    n = b.shape[0]
    if qtype == Q.Q6_K:
        low = _nibbles(b[:, 0:128].reshape(n, 2, 64))
        high = _bits(b[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, 2, 128)
        dl = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
        return (low | (high << 4)).reshape(n, 256), dl, -32 * dl
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = unpack_k_scales(b[:, 4:16])
    dl, ml = d * sc.to(torch.float32), dmin * mn.to(torch.float32)
    low = _nibbles(b[:, -128:].reshape(n, 4, 32)).reshape(n, 256)
    if qtype == Q.Q4_K:
        return low, dl, -ml
    return low | (_bits(b[:, 16:48], 1, 8).reshape(n, 256) << 4), dl, -ml  # Q5_K


def _mxfp4(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """u, scale, zero of MXFP4 blocks ``[n, 17]``: u = the doubled E2M1 value + 12."""
    d = e8m0_half(b[:, 0])
    table = torch.tensor([v + 12 for v in MXFP4_VALUES], dtype=torch.uint8)
    return table[_nibbles(b[:, 1:]).long()], d, -12 * d


def quantized_rows(weight: QTensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows `rows` of a quantized matrix as ``(u [n, K] uint8, scale [n, K / group], zero [n, K / group])`` with
    ``u * scale + zero`` (per group) equal to `gpullama.quants.dequantize`."""
    _, ts = gguf.GGML_QUANT_SIZES[weight.qtype]
    data = weight.data[rows]
    n = data.shape[0]
    b = data.reshape(-1, ts)
    if weight.qtype == Q.MXFP4:
        u, scale, zero = _mxfp4(b)
    else:
        u, scale, zero = (_k_quant if weight.qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else _legacy)(b, weight.qtype)
    return u.reshape(n, -1), scale.reshape(n, -1), zero.reshape(n, -1)


class _NotHalf(Exception):
    """A scale or zero is not a float16 value."""


def _blocks(values: torch.Tensor, *per_row: torch.Tensor) -> torch.Tensor:
    """Rows (a multiple of 16) as the kernels' blocks ``[n / 16, K / 32, block bytes]`` uint8: per 16 rows and 32
    values, the values (`values` ``[n, K / 32, chunks, width]``: chunk c of every row, then chunk c + 1), then each
    of `per_row` (``[n, K / 32, sets]``: set t of every row, then set t + 1)."""
    n, groups = values.shape[:2]

    def interleave(t: torch.Tensor) -> torch.Tensor:  # [n, groups, a, b] -> [n / 16, groups, a * 16 * b bytes]
        t = t.reshape(n // 16, 16, groups, t.shape[2], -1).permute(0, 2, 3, 1, 4).contiguous()
        return t.view(torch.uint8).reshape(n // 16, groups, -1)

    return torch.cat([interleave(values)] + [interleave(t.reshape(n, groups, -1, 1)) for t in per_row], dim=-1)


@dataclass
class CpuWeight:
    """One matrix in a `cpu_native` weight format; `matmul` computes ``x @ W.T``."""

    fmt: int  # cpu_native.FMT_*
    group: int  # values per scale (Q4, Q8)
    half_scales: bool  # scales and zeros stored as float16 (exact for the types whose fields are float16)
    blocks: torch.Tensor  # uint8 [N padded to 16 / 16, K / 32, block bytes]
    out_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.blocks.nbytes

    @classmethod
    def from_qtensor(cls, weight: QTensor) -> CpuWeight:
        """Repack a 2-D GGUF matrix whose rows are a multiple of 32 values (see `packable`), a few thousand rows at
        a time."""
        if weight.qtype in HALF_SCALE_TYPES:
            try:
                return cls._pack(weight, half_scales=True)
            except _NotHalf:  # a scale or zero float16 cannot hold (-8d overflowing): keep them float32
                pass
        return cls._pack(weight, half_scales=False)

    @classmethod
    def _pack(cls, weight: QTensor, half_scales: bool) -> CpuWeight:
        n, k = weight.shape
        dense = weight.qtype in (Q.F16, Q.BF16, Q.F32)
        if dense:
            fmt, group = (cpu_native.FMT_F16 if weight.qtype == Q.F16 else cpu_native.FMT_F32), 32
        else:
            fmt = cpu_native.FMT_Q4 if weight.qtype in Q4_TYPES else cpu_native.FMT_Q8
            group = 16 if weight.qtype == Q.Q6_K else 32
        chunks = []
        for start in range(0, n, _CHUNK_ROWS):
            rows = slice(start, start + _CHUNK_ROWS)
            if dense:
                parts = [weight.data[rows] if fmt == cpu_native.FMT_F16 else weight.data[rows].to(torch.float32)]
            else:
                parts = list(quantized_rows(weight, rows))
                if half_scales:
                    halves = [t.to(torch.float16) for t in parts[1:]]
                    if any(not torch.equal(h.float(), t) for h, t in zip(halves, parts[1:])):
                        raise _NotHalf
                    parts[1:] = halves
            pad = -parts[0].shape[0] % _ROW_ALIGN  # only the last chunk can be short; rows of zeros compute 0
            if pad:
                parts = [torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in parts]
            values = parts[0].reshape(parts[0].shape[0], k // 32, 32)
            if dense:  # value k of the 16 rows, then value k + 1
                values = values.unsqueeze(-1)
            elif fmt == cpu_native.FMT_Q4:  # byte j: value j in its low nibble, value j + 16 in its high nibble
                values = (values[..., :16] | (values[..., 16:] << 4)).reshape(-1, k // 32, 4, 4)
            else:
                values = values.reshape(-1, k // 32, 8, 4)
            chunks.append(_blocks(values, *parts[1:]))
        return cls(fmt, group, half_scales, torch.cat(chunks), n)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] @ W.T``: float32 ``[M, N]`` (a column slice of a wider result where N was padded)."""
        out = x.new_empty(x.shape[0], 16 * self.blocks.shape[0])
        cpu_native.matmul(self.fmt, self.group, self.half_scales, x, self.blocks, out)
        return out if out.shape[1] == self.out_features else out[:, : self.out_features]


def packable(weight: QTensor) -> bool:
    """Whether `weight` has a CPU format: a 2-D matrix of a supported type with rows a multiple of 32 values."""
    return (
        len(weight.shape) == 2
        and weight.shape[1] % 32 == 0
        and weight.qtype in Q4_TYPES + Q8_TYPES + (Q.F16, Q.BF16, Q.F32)
    )


@dataclass
class CpuExperts:
    """A MoE layer's E expert matrices of one kind (gate|up, or down) in one `cpu_native` format, stacked:
    ``blocks [E, N padded to 16 / 16, K / 32, block bytes]``, as `cpu_native.moe` reads them."""

    fmt: int
    group: int
    half_scales: bool
    blocks: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.blocks.nbytes

    @property
    def operand(self) -> tuple[int, int, bool, torch.Tensor]:
        """(fmt, group, half_scales, blocks), as `cpu_native.moe` takes them."""
        return self.fmt, self.group, self.half_scales, self.blocks

    @classmethod
    def from_qtensors(cls, parts: list[QTensor]) -> CpuExperts:
        """Pack stacked experts ``[E, rows, K]`` (the parts' rows of each expert joined: gate then up), one expert
        at a time; all of them with float16 scales where every scale is a float16 value, else float32."""
        num_experts = parts[0].shape[0]

        def expert(e: int) -> QTensor:
            data = [p.data[e] for p in parts]
            rows = sum(p.shape[1] for p in parts)
            joined = data[0] if len(data) == 1 else torch.cat(data, dim=0)
            return QTensor(joined, parts[0].qtype, (rows, parts[0].shape[2]), parts[0].name)

        half = parts[0].qtype in HALF_SCALE_TYPES
        while True:  # one layer's experts at a time into one buffer (no second copy of them at load)
            try:
                first = CpuWeight._pack(expert(0), half_scales=half)
                blocks = first.blocks.new_empty((num_experts, *first.blocks.shape))
                blocks[0] = first.blocks
                for e in range(1, num_experts):
                    blocks[e] = CpuWeight._pack(expert(e), half_scales=half).blocks
                break
            except _NotHalf:
                half = False
        return cls(first.fmt, first.group, half, blocks)


def packable_experts(parts: list[QTensor]) -> bool:
    """Whether stacked experts have a CPU format: one type, a quantized one or F16/BF16/F32, rows of a multiple of
    32 values."""
    first = parts[0]
    return (
        all(len(p.shape) == 3 and p.qtype == first.qtype and p.shape[2] == first.shape[2] for p in parts)
        and first.shape[2] % 32 == 0
        and first.qtype in Q4_TYPES + Q8_TYPES + (Q.F16, Q.BF16, Q.F32)
    )
