"""CPU weight formats of the fast path: GGUF blocks mapped group by group onto torch's int4 CPU matmul.

``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`` computes ``x @ W.T`` for

    W[n, k] = (q[n, k] - 8) * scale[k // 32, n] + zero[k // 32, n]        q in 0..15

with bfloat16 ``x``, ``scale`` and ``zero`` (``scales_and_zeros`` is ``[K / 32, N, 2]``), float32 FMAs and a
bfloat16 result. Each output row is computed on its own, so a row's result does not depend on the other rows of
the batch. A type of at most 4 bits maps onto it as it is. A 5- to 8-bit type is split into two 4-bit parts, its
low nibble and its high bits, ``W = W_lo + W_hi``, laid side by side along K; ``x`` is repeated ``[x | x]`` and one
call computes both (8 bits a value plus the scales, against 16 for bfloat16). Q6_K's scales cover 16 values,
narrower than the kernel's smallest group (32): each group of 32 holds one sub-block's low nibbles and its high
bits, and ``x`` comes in as ``[x_16 | 16 * x_16]`` per sub-block (16x is exact), so both halves share the scale.
Float matrices (F16, BF16, F32) become dense bfloat16 for oneDNN's prepacked linear, whose rows can depend on the
batch (seen from about 32 rows on); every GGUF-quantized matrix goes through the int4 kernel.

Per type (``d``, ``m``, ``sc``, ``mn``: the block's fields as in `gpullama.quants`; ``dl = d * sc``,
``ml = dmin * mn`` for each sub-block of 32; ``l`` the low nibble, ``h`` the high bits of a quant):

    Q4_0   d * (q - 8)            one part:  q,      scale d,       zero 0
    Q4_1   d * q + m              one part:  q,      scale d,       zero m + 8d
    Q4_K   dl * q - ml            one part:  q,      scale dl,      zero 8 dl - ml
    Q5_0   d * (q - 16)           lo: l, scale d, zero 8d;       hi: h + 7, scale 16d,  zero 0
    Q5_1   d * q + m              lo: l, scale d, zero 8d + m;   hi: h + 8, scale 16d,  zero 0
    Q5_K   dl * q - ml            lo: l, scale dl, zero 8dl - ml; hi: h + 8, scale 16dl, zero 0
    Q8_0   d * q  (q signed)      lo: q & 15, scale d, zero 8d;  hi: (q >> 4) + 8, scale 16d, zero 0
    Q6_K   dl * (q - 32)          per 16: l | h + 6 in one group (x | 16x), scale dl, zero 8 dl / 17
    F16, BF16, F32                dense bfloat16 (oneDNN's prepacked linear)

(Q6_K: ``x (l - 8) dl + 16x (h + 6 - 8) dl + 17x z = x dl (l + 16h - 32)`` for ``z = 8 dl / 17``.) Every zero
above that is a power-of-two multiple of the scale stays exact after rounding to bfloat16, so Q4_0, Q5_0 and
Q8_0 compute exactly ``bf16(d) * q``; the others are within bfloat16 rounding of their scale and zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from gpullama.quants import QTensor, _bits, _f16, _nibbles, _q5_quants, unpack_k_scales

Q = gguf.GGMLQuantizationType

GROUP = 32  # values per scale/zero group of the int4 kernel (its smallest)
_ROW_ALIGN = 16  # the kernel packs rows in blocks of 16 (64 on AVX-512): pad N to a multiple of it
_CHUNK_ROWS = 4096  # rows converted at a time (a multiple of 64), to bound the memory a load needs

INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
"""Types stored as one 4-bit part."""
SPLIT_TYPES = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q8_0)
"""Types stored as two 4-bit parts (low nibble and high bits), side by side along K."""
PAIRED_TYPES = (Q.Q6_K,)
"""Types stored as low nibble and high bits of each 16-value sub-block in one group of 32."""


def has_int4_kernel() -> bool:
    """Whether this torch build has the int4 CPU matmul (torch >= 2.5 on x86 or Arm)."""
    aten = torch.ops.aten
    return hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(aten, "_convert_weight_to_int4pack_for_cpu")


# ---------------------------------------------------------------------------------------------------
# GGUF blocks -> 4-bit parts: (q uint8 [N, K] in 0..15, scale float32 [N, K / 32], zero float32 [N, K / 32])
# ---------------------------------------------------------------------------------------------------

Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _blocks(weight: QTensor, rows: slice) -> torch.Tensor:
    """Rows `rows` of a 2-D quantized weight as ``[n, blocks_per_row, type_size]`` uint8."""
    _, ts = gguf.GGML_QUANT_SIZES[weight.qtype]
    data = weight.data[rows]
    return data.reshape(data.shape[0], -1, ts)


def _legacy_parts(weight: QTensor, rows: slice) -> list[Part]:
    """Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (one scale per block of 32)."""
    b = _blocks(weight, rows)
    n, nb = b.shape[:2]
    b = b.reshape(n * nb, -1)
    d = _f16(b[:, 0:2])  # [n * nb, 1]
    t = weight.qtype
    if t == Q.Q8_0:
        q8 = b[:, 2:].contiguous().view(torch.int8)
        lo, hi = (q8 & 15).to(torch.uint8), ((q8 >> 4) + 8).to(torch.uint8)
        parts = [(lo, d, 8 * d), (hi, 16 * d, torch.zeros_like(d))]
    elif t == Q.Q4_0:
        parts = [(_nibbles(b[:, 2:]), d, torch.zeros_like(d))]
    elif t == Q.Q4_1:
        m = _f16(b[:, 2:4])
        parts = [(_nibbles(b[:, 4:]), d, m + 8 * d)]
    else:  # Q5_0 / Q5_1: 5-bit quants, high bit apart
        q5 = _q5_quants(b[:, 2:6], b[:, 6:]) if t == Q.Q5_0 else _q5_quants(b[:, 4:8], b[:, 8:])
        lo, hi = q5 & 15, q5 >> 4
        if t == Q.Q5_0:  # d * (q - 16) = d * l + 16d * (h - 1)
            parts = [(lo, d, 8 * d), (hi + 7, 16 * d, torch.zeros_like(d))]
        else:
            m = _f16(b[:, 2:4])
            parts = [(lo, d, 8 * d + m), (hi + 8, 16 * d, torch.zeros_like(d))]
    return [(q.reshape(n, nb * 32), s.reshape(n, nb), z.reshape(n, nb)) for q, s, z in parts]


def _k_quant_parts(weight: QTensor, rows: slice) -> list[Part]:
    """Q4_K and Q5_K (super-blocks of 256 = 8 sub-blocks of 32, each with its scale and min)."""
    b = _blocks(weight, rows)
    n, nb = b.shape[:2]
    b = b.reshape(n * nb, -1)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = unpack_k_scales(b[:, 4:16])
    dl = d * sc.to(torch.float32)  # [n * nb, 8]
    ml = dmin * mn.to(torch.float32)
    if weight.qtype == Q.Q4_K:
        q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
        parts = [(q, dl, 8 * dl - ml)]
    else:
        low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
        shifts = torch.arange(8, dtype=torch.uint8).reshape(8, 1)
        high = (b[:, 16:48].unsqueeze(-2) >> shifts) & 1  # bit s of qh[l]: 5th bit of sub-block s, value l
        parts = [(low, dl, 8 * dl - ml), (high + 8, 16 * dl, torch.zeros_like(dl))]
    return [(q.reshape(n, nb * 256), s.reshape(n, nb * 8), z.reshape(n, nb * 8)) for q, s, z in parts]


def int4_parts(weight: QTensor, rows: slice = slice(None)) -> list[Part]:
    """The 4-bit parts of rows `rows` of a 2-D weight whose type is in INT4_TYPES or SPLIT_TYPES; summed, their
    ``(q - 8) * scale + zero`` equal `gpullama.quants.dequantize` (in float32, before any bfloat16 rounding)."""
    if weight.qtype in (Q.Q4_K, Q.Q5_K):
        return _k_quant_parts(weight, rows)
    if weight.qtype in INT4_TYPES + SPLIT_TYPES:
        return _legacy_parts(weight, rows)
    raise ValueError(f"no 4-bit parts for type {weight.qtype.name}")


def q6_k_groups(weight: QTensor, rows: slice = slice(None)) -> Part:
    """Rows `rows` of a Q6_K matrix as 4-bit groups of 32: ``q [n, 2K]`` (per sub-block of 16: its low nibbles,
    then its high bits + 6), scale and zero ``[n, K / 16]`` (``dl`` and ``8 dl / 17``), for the input
    ``[x_16 | 16 x_16]`` of each sub-block (see the module's table)."""
    b = _blocks(weight, rows)
    n, nb = b.shape[:2]
    b = b.reshape(n * nb, -1)
    low = _nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 16, 1, 16)
    high = _bits(b[:, 128:192].reshape(-1, 2, 32), 2, 4).reshape(-1, 16, 1, 16)
    q = torch.cat([low, high + 6], dim=2)  # [n * nb, 16 sub-blocks, 2, 16]
    dl = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # [n * nb, 16]
    return q.reshape(n, nb * 512), dl.reshape(n, nb * 16), (dl * (8 / 17)).reshape(n, nb * 16)


# ---------------------------------------------------------------------------------------------------
# prepared weights
# ---------------------------------------------------------------------------------------------------


@dataclass
class Int4Weight:
    """A matrix in torch's packed int4 CPU layout, one scale/zero per group of 32 along its (expanded) K."""

    packed: torch.Tensor  # uint8 [N padded to 16, K' / 2]
    scales_and_zeros: torch.Tensor  # bfloat16 [K' / 32, N padded, 2]
    out_features: int
    layout: str  # what the kernel's K' holds: "plain" (K' = K), "twice" ([x | x]), "pairs" ([x_16 | 16 x_16] per 16)

    @classmethod
    def from_qtensor(cls, weight: QTensor) -> Int4Weight:
        """Pack a matrix of a type in INT4_TYPES, SPLIT_TYPES or PAIRED_TYPES, a few thousand rows at a time."""
        n, _ = weight.shape
        packed, scales = [], []
        for start in range(0, n, _CHUNK_ROWS):
            rows = slice(start, start + _CHUNK_ROWS)
            parts = [q6_k_groups(weight, rows)] if weight.qtype in PAIRED_TYPES else int4_parts(weight, rows)
            q = torch.cat([p[0] for p in parts], dim=1).to(torch.int32)
            s = torch.cat([p[1] for p in parts], dim=1)
            z = torch.cat([p[2] for p in parts], dim=1)
            pad = -q.shape[0] % _ROW_ALIGN  # only the last chunk can be short
            if pad:  # rows of zeros: q = 8, scale = zero = 0
                q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=torch.int32)])
                s, z = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (s, z))
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2))
            scales.append(torch.stack([s, z], dim=-1).to(torch.bfloat16))  # [rows, groups, 2]
        layout = "pairs" if weight.qtype in PAIRED_TYPES else "twice" if weight.qtype in SPLIT_TYPES else "plain"
        return cls(torch.cat(packed), torch.cat(scales).transpose(0, 1).contiguous(), n, layout)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for bfloat16 ``x [T, K]``: bfloat16 ``[T, N]``."""
        if self.layout == "twice":
            x = x.repeat(1, 2)
        elif self.layout == "pairs":
            x16 = x.view(x.shape[0], -1, 1, 16)
            x = torch.cat([x16, x16 * 16], dim=2).view(x.shape[0], -1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        return out if out.shape[1] == self.out_features else out[:, : self.out_features]

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.packed.nbytes + self.scales_and_zeros.nbytes


@dataclass
class DenseWeight:
    """A bfloat16 matrix, prepacked for oneDNN's linear where this torch has it."""

    weight: torch.Tensor  # bfloat16 [N, K], or its oneDNN-packed form
    packed: bool

    @classmethod
    def from_qtensor(cls, weight: QTensor, packed: bool) -> DenseWeight:
        """Dequantize (exactly, in float32) and round to bfloat16 once."""
        dense = weight.dequantize(torch.float32).to(torch.bfloat16).contiguous()
        return cls(torch.ops.mkldnn._reorder_linear_weight(dense) if packed else dense, packed)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for bfloat16 ``x [T, K]``: bfloat16 ``[T, N]``."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return torch.nn.functional.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.weight.nbytes


CpuWeight = Int4Weight | DenseWeight


def prepare_cpu_weight(weight: QTensor, packed_linear: bool) -> CpuWeight:
    """The fast path's form of one 2-D GGUF weight (see the table at the top of this module)."""
    fits = weight.shape[-1] % GROUP == 0 and has_int4_kernel()
    if fits and weight.qtype in INT4_TYPES + SPLIT_TYPES + PAIRED_TYPES:
        return Int4Weight.from_qtensor(weight)
    return DenseWeight.from_qtensor(weight, packed_linear)
