"""GGUF weight types in torch: block layouts, exact dequantizers and the `QTensor` weight container.

Every quantized type stores a row of `cols` values as `cols // block_size` blocks of `type_size` bytes.
The `dequantize_*` functions below take raw blocks `[..., type_size]` (uint8) and return float32
`[..., block_size]`; they follow gguf's `quants.py` (the reference, bit-exact: same float32 operations in
the same order) and are the oracle for the Triton kernels. All multi-byte fields are little-endian.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import gguf
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, QK_K

Q = gguf.GGMLQuantizationType

SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4}
)
"""The GGUF tensor types gpullama can load."""

FLOAT_TYPES: dict[gguf.GGMLQuantizationType, torch.dtype] = {
    Q.F32: torch.float32,
    Q.F16: torch.float16,
    Q.BF16: torch.bfloat16,
}
"""Unquantized types and the torch dtype their data is kept in."""

_K_SCALE_SIZE = 12  # bytes of packed 6-bit scales/mins in Q4_K and Q5_K


# ----------------------------------------------------------------------------------------------------
# type sizes and validation
# ----------------------------------------------------------------------------------------------------


def _type_name(qtype: object) -> str:
    """Readable name of a tensor type (enum member, or raw int that may not be in the enum)."""
    if isinstance(qtype, Q):
        return qtype.name
    try:
        return Q(int(qtype)).name  # type: ignore[call-overload]
    except (ValueError, TypeError):
        return str(qtype)


def _where(name: str | None) -> str:
    return f" for tensor '{name}'" if name else ""


def check_supported(qtype: object, name: str | None = None) -> gguf.GGMLQuantizationType:
    """Return `qtype` as a GGMLQuantizationType, or raise ValueError naming it (and the tensor) if unsupported."""
    try:
        member = qtype if isinstance(qtype, Q) else Q(int(qtype))  # type: ignore[call-overload]
    except (ValueError, TypeError):
        member = None
    if member not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"unsupported tensor type {_type_name(qtype)}{_where(name)} (supported: {supported})")
    return member  # type: ignore[return-value]


def block_size(qtype: object, name: str | None = None) -> int:
    """Number of values in one block of `qtype` (1 for F32/F16/BF16)."""
    return GGML_QUANT_SIZES[check_supported(qtype, name)][0]


def type_size(qtype: object, name: str | None = None) -> int:
    """Number of bytes in one block of `qtype`."""
    return GGML_QUANT_SIZES[check_supported(qtype, name)][1]


def expected_nbytes(qtype: object, shape: tuple[int, ...], name: str | None = None) -> int:
    """Bytes a tensor of logical `shape` takes in `qtype`; ValueError if the row length is not whole blocks."""
    qtype = check_supported(qtype, name)
    bs, ts = GGML_QUANT_SIZES[qtype]
    if len(shape) == 0 or any(int(d) < 0 for d in shape):
        raise ValueError(f"invalid shape {tuple(shape)}{_where(name)}: need at least one non-negative dim")
    if shape[-1] % bs != 0:
        raise ValueError(
            f"row length {shape[-1]}{_where(name)} is not a multiple of the {qtype.name} block size {bs}"
        )
    return math.prod(shape) // bs * ts


def _check_data(data: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], name: str | None) -> None:
    """Raise ValueError if `data` has the wrong dtype or byte count for `shape` in `qtype`."""
    if not isinstance(data, torch.Tensor):
        raise ValueError(f"tensor data{_where(name)} must be a torch.Tensor, got {type(data).__name__}")
    want_dtype = FLOAT_TYPES.get(qtype)
    if want_dtype is None:
        ok = data.dtype == torch.uint8
        allowed = "uint8"
    else:
        # typed data, or the same bytes as uint8 / a same-width integer (BF16 comes as uint8 or int16)
        same_width = {2: (torch.int16, torch.uint16), 4: (torch.int32,)}[want_dtype.itemsize]
        ok = data.dtype in (want_dtype, torch.uint8, *same_width)
        allowed = ", ".join(str(d).removeprefix("torch.") for d in (want_dtype, torch.uint8, *same_width))
    if not ok:
        raise ValueError(
            f"{qtype.name} data{_where(name)} has dtype {str(data.dtype).removeprefix('torch.')}; expected one of {allowed}"
        )
    want = expected_nbytes(qtype, shape, name)
    got = data.numel() * data.element_size()
    if got != want:
        raise ValueError(
            f"{qtype.name} data{_where(name)}: shape {tuple(shape)} needs {want} bytes, got {got} "
            f"(data shape {tuple(data.shape)}, dtype {str(data.dtype).removeprefix('torch.')})"
        )


# ----------------------------------------------------------------------------------------------------
# small helpers on raw bytes
# ----------------------------------------------------------------------------------------------------


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 field `[..., 2]` uint8 -> float32 `[..., 1]`."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """`[..., n]` uint8 -> `[..., 2n]`: the n low nibbles, then the n high nibbles."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def _bits(b: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """`[..., n]` uint8 -> `[..., count, n]`: field k is `(b >> (k * width)) & mask` (uint8)."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8, device=b.device).reshape(count, 1)
    return (b.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _as_blocks(blocks: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Flatten `[..., type_size]` uint8 into `[n_blocks, type_size]`; also return the leading shape."""
    ts = GGML_QUANT_SIZES[qtype][1]
    if blocks.dtype != torch.uint8 or blocks.ndim == 0 or blocks.shape[-1] != ts:
        raise ValueError(
            f"{qtype.name} blocks must be uint8 [..., {ts}], got {str(blocks.dtype).removeprefix('torch.')} "
            f"{tuple(blocks.shape)}"
        )
    return blocks.reshape(-1, ts), tuple(blocks.shape[:-1])


# ----------------------------------------------------------------------------------------------------
# legacy 32-value blocks
# ----------------------------------------------------------------------------------------------------


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks `[..., 34]` -> float32 `[..., 32]`.

    Block of 32 values, 34 bytes:
      d   f16       @0   scale
      qs  int8[32]  @2   quants
    x[i] = qs[i] * d
    """
    b, lead = _as_blocks(blocks, Q.Q8_0)
    d = _f16(b[:, 0:2])
    qs = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (qs * d).reshape(*lead, 32)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks `[..., 18]` -> float32 `[..., 32]`.

    Block of 32 values, 18 bytes:
      d   f16        @0   scale
      qs  uint8[16]  @2   4-bit quants: x[i] in low nibble of qs[i], x[i + 16] in high nibble
    x[i] = d * (q[i] - 8)
    """
    b, lead = _as_blocks(blocks, Q.Q4_0)
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8
    return (d * q.to(torch.float32)).reshape(*lead, 32)


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks `[..., 20]` -> float32 `[..., 32]`.

    Block of 32 values, 20 bytes:
      d   f16        @0   scale
      m   f16        @2   min
      qs  uint8[16]  @4   4-bit quants: x[i] in low nibble of qs[i], x[i + 16] in high nibble
    x[i] = d * q[i] + m
    """
    b, lead = _as_blocks(blocks, Q.Q4_1)
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:]).to(torch.float32)
    return (d * q + m).reshape(*lead, 32)


def _q5_quants(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit quants of a Q5_0/Q5_1 block: low nibbles from `qs` [n, 16], bit i of little-endian u32 `qh` [n, 4] is bit 4 of q[i]."""
    high = _bits(qh, 1, 8).transpose(-1, -2).reshape(qh.shape[0], 32)  # bit i of the u32 = bit i % 8 of byte i // 8
    return _nibbles(qs) | (high << 4)


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks `[..., 22]` -> float32 `[..., 32]`.

    Block of 32 values, 22 bytes:
      d   f16        @0   scale
      qh  uint8[4]   @2   bit i of this little-endian u32 is bit 4 of q[i]
      qs  uint8[16]  @6   low 4 bits: q[i] in low nibble of qs[i], q[i + 16] in high nibble
    x[i] = d * (q[i] - 16)
    """
    b, lead = _as_blocks(blocks, Q.Q5_0)
    d = _f16(b[:, 0:2])
    q = _q5_quants(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return (d * q.to(torch.float32)).reshape(*lead, 32)


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1 blocks `[..., 24]` -> float32 `[..., 32]`.

    Block of 32 values, 24 bytes:
      d   f16        @0   scale
      m   f16        @2   min
      qh  uint8[4]   @4   bit i of this little-endian u32 is bit 4 of q[i]
      qs  uint8[16]  @8   low 4 bits: q[i] in low nibble of qs[i], q[i + 16] in high nibble
    x[i] = d * q[i] + m
    """
    b, lead = _as_blocks(blocks, Q.Q5_1)
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    q = _q5_quants(b[:, 4:8], b[:, 8:]).to(torch.float32)
    return (d * q + m).reshape(*lead, 32)


# ----------------------------------------------------------------------------------------------------
# K-quants: 256-value super-blocks
# ----------------------------------------------------------------------------------------------------


def unpack_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K packed 6-bit scales `[n, 12]` uint8 -> (sc, mn), each `[n, 8]` uint8.

    Bytes 0-3 hold sc[0..3] in bits 0-5, bytes 4-7 hold mn[0..3] in bits 0-5; byte 8+j holds the low
    4 bits of sc[4+j] (low nibble) and mn[4+j] (high nibble), whose top 2 bits are bits 6-7 of bytes j and 4+j.
    """
    s = scales.reshape(-1, 3, 4)
    lo_d, lo_m, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo_d & 0x3F, (hi & 0x0F) | ((lo_d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
    return sc, mn


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks `[..., 144]` -> float32 `[..., 256]`.

    Super-block of 256 values = 8 sub-blocks of 32, 144 bytes:
      d, dmin  f16 x2       @0   super-block scale of the scales / of the mins
      scales   uint8[12]    @4   8 6-bit scales sc[j] and 8 6-bit mins mn[j], packed (see unpack_k_scales)
      qs       uint8[128]   @16  4 chunks of 32 bytes; chunk c: low nibbles = sub-block 2c, high = 2c + 1
    x[j, l] = (d * sc[j]) * q[j, l] - dmin * mn[j]
    """
    b, lead = _as_blocks(blocks, Q.Q4_K)
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    dmin = _f16(b[:, 2:4])
    sc, mn = unpack_k_scales(b[:, 4 : 4 + _K_SCALE_SIZE])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(*lead, QK_K)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks `[..., 176]` -> float32 `[..., 256]`.

    Super-block of 256 values = 8 sub-blocks of 32, 176 bytes:
      d, dmin  f16 x2       @0   super-block scale of the scales / of the mins
      scales   uint8[12]    @4   8 6-bit scales and 8 6-bit mins, packed as in Q4_K
      qh       uint8[32]    @16  bit j of qh[l] is bit 4 of q[j, l]
      qs       uint8[128]   @48  low 4 bits, laid out as Q4_K's qs
    x[j, l] = (d * sc[j]) * q[j, l] - dmin * mn[j]
    """
    b, lead = _as_blocks(blocks, Q.Q5_K)
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    dmin = _f16(b[:, 2:4])
    sc, mn = unpack_k_scales(b[:, 4 : 4 + _K_SCALE_SIZE])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    low = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = _bits(b[:, 16:48], 1, 8)  # [n, 8, 32]
    q = (low | (high << 4)).to(torch.float32)
    return (dl * q - ml).reshape(*lead, QK_K)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks `[..., 210]` -> float32 `[..., 256]`.

    Super-block of 256 values = 2 halves of 128 = 16 sub-blocks of 16, 210 bytes:
      ql      uint8[128]  @0    low 4 bits; half h: bytes 64h..64h+63, low nibbles = values 0-63, high = 64-127
      qh      uint8[64]   @128  high 2 bits; half h: byte 32h + l, bits 2k..2k+1 = value 32k + l
      scales  int8[16]    @192  one scale per 16 values
      d       f16         @208  super-block scale
    x[i] = (d * scales[i // 16]) * (q[i] - 32)
    """
    b, lead = _as_blocks(blocks, Q.Q6_K)
    n = b.shape[0]
    low = _nibbles(b[:, 0:128].reshape(n, 2, 64))  # [n, 2, 128]
    high = _bits(b[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, 2, 128)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    return (dl * q.to(torch.float32)).reshape(*lead, QK_K)


# ----------------------------------------------------------------------------------------------------
# MXFP4 (OCP microscaling FP4, gpt-oss's experts)
# ----------------------------------------------------------------------------------------------------

MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""The 16 E2M1 values, doubled (ggml's ``kvalues_mxfp4``): sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2."""


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """An E8M0 exponent byte as the float32 ``2^(e - 127) / 2`` (ggml's ``e8m0_to_fp32_half``; subnormal for e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks `[..., 17]` -> float32 `[..., 32]`.

    Block of 32 values, 17 bytes:
      e   uint8      @0   E8M0 shared exponent
      qs  uint8[16]  @1   4-bit E2M1 codes: x[i] in low nibble of qs[i], x[i + 16] in high nibble
    x[i] = e8m0_half(e) * MXFP4_VALUES[q[i]]   (exact in float32: the scale is a power of two)
    """
    b, lead = _as_blocks(blocks, Q.MXFP4)
    d = e8m0_half(b[:, 0:1])
    table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
    q = _nibbles(b[:, 1:]).long()
    return (d * table[q]).reshape(*lead, 32)


_BLOCK_DEQUANTIZERS: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: dequantize_q8_0,
    Q.Q4_0: dequantize_q4_0,
    Q.Q4_1: dequantize_q4_1,
    Q.Q5_0: dequantize_q5_0,
    Q.Q5_1: dequantize_q5_1,
    Q.Q4_K: dequantize_q4_k,
    Q.Q5_K: dequantize_q5_k,
    Q.Q6_K: dequantize_q6_k,
    Q.MXFP4: dequantize_mxfp4,
}


# ----------------------------------------------------------------------------------------------------
# whole tensors
# ----------------------------------------------------------------------------------------------------


def _typed(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret raw bytes / same-width integers as `dtype` (no copy when already contiguous)."""
    if data.dtype == dtype:
        return data
    return data.contiguous().reshape(-1).view(dtype)


def dequantize(
    data: torch.Tensor, qtype: object, shape: tuple[int, ...], name: str | None = None
) -> torch.Tensor:
    """Dequantize GGUF tensor data of type `qtype` to a new float32 tensor of logical `shape` (never a view of `data`)."""
    qtype = check_supported(qtype, name)
    shape = tuple(int(s) for s in shape)
    _check_data(data, qtype, shape, name)
    float_dtype = FLOAT_TYPES.get(qtype)
    if float_dtype is not None:
        out = _typed(data, float_dtype).reshape(shape)
        # F32 data may be a view of the read-only file map: always hand back a fresh tensor
        return out.to(torch.float32, copy=True)
    ts = GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(-1, ts)
    return _BLOCK_DEQUANTIZERS[qtype](blocks).reshape(shape)


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a numpy array, read-only memory maps included (never write to the result)."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(array)


@dataclass
class QTensor:
    """A GGUF weight as stored: raw blocks (or a typed float tensor), its type and its logical torch shape.

    For quantized types `data` is uint8 `[*shape[:-1], bytes_per_row]`; for F32/F16/BF16 it is the typed
    tensor (float32/float16/bfloat16) of `shape`. Data loaded from a file may be a read-only view of the
    memory map: it is never written to; every operation returns new tensors.
    """

    data: torch.Tensor
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    name: str = ""

    def __post_init__(self) -> None:
        self.qtype = check_supported(self.qtype, self.name)
        self.shape = tuple(int(s) for s in self.shape)
        _check_data(self.data, self.qtype, self.shape, self.name)
        float_dtype = FLOAT_TYPES.get(self.qtype)
        if float_dtype is not None:
            self.data = _typed(self.data, float_dtype).reshape(self.shape)
        else:
            self.data = self.data.reshape(*self.shape[:-1], self.row_nbytes)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (the last dim) in this tensor's type."""
        return expected_nbytes(self.qtype, (self.shape[-1],), self.name)

    @property
    def nbytes(self) -> int:
        """Bytes the stored data takes."""
        return self.data.numel() * self.data.element_size()

    @property
    def device(self) -> torch.device:
        """Device the data lives on."""
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized values as a new tensor of `shape` in `dtype` (computed in float32)."""
        return dequantize(self.data, self.qtype, self.shape, self.name).to(dtype)

    def take_rows(self, index: torch.Tensor) -> QTensor:
        """Gather rows (first dim) of the stored blocks: shape `(*index.shape, *shape[1:])`, same type."""
        if len(self.shape) < 2:
            raise ValueError(f"take_rows needs a tensor of 2+ dims{_where(self.name)}, got shape {self.shape}")
        if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            got = index.dtype if isinstance(index, torch.Tensor) else type(index).__name__
            raise ValueError(f"take_rows{_where(self.name)} needs an integer index tensor, got {got}")
        flat = index.reshape(-1).to(device=self.data.device, dtype=torch.int64)
        rows = self.shape[0]
        if flat.device.type == "cpu" and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
            raise ValueError(
                f"take_rows{_where(self.name)}: row index out of range [0, {rows}) "
                f"(got min {int(flat.min())}, max {int(flat.max())})"
            )
        picked = self.data.index_select(0, flat).reshape(*index.shape, *self.data.shape[1:])
        return QTensor(picked, self.qtype, (*index.shape, *self.shape[1:]), self.name)

    def slice_rows(self, start: int, stop: int) -> QTensor:
        """Rows ``start:stop`` of the first dim, same type: a view of the stored data (a file's pages stay unread
        until used). A 1-D tensor slices its values, which only a float type allows."""
        if len(self.shape) == 1 and self.qtype not in FLOAT_TYPES:
            raise ValueError(f"cannot slice the values of a 1-D {self.qtype.name} tensor{_where(self.name)}")
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows {start}:{stop}{_where(self.name)} are outside [0, {self.shape[0]}]")
        return QTensor(self.data[start:stop], self.qtype, (stop - start, *self.shape[1:]), self.name)

    def slice_cols(self, start: int, stop: int) -> QTensor:
        """Columns ``start:stop`` of the last dim, same type, in whole blocks (a copy); ValueError naming the tensor
        when a bound cuts a block."""
        bs = block_size(self.qtype)
        cols = self.shape[-1]
        if not 0 <= start <= stop <= cols:
            raise ValueError(f"columns {start}:{stop}{_where(self.name)} are outside [0, {cols}]")
        if start % bs or stop % bs:
            raise ValueError(
                f"columns {start}:{stop}{_where(self.name)} cut a {self.qtype.name} block of {bs} values"
            )
        if self.qtype in FLOAT_TYPES:
            data = self.data[..., start:stop]
        else:
            ts = type_size(self.qtype)
            data = self.data[..., start // bs * ts : stop // bs * ts]
        return QTensor(data.contiguous(), self.qtype, (*self.shape[:-1], stop - start), self.name)

    def pad_rows(self, rows: int) -> QTensor:
        """This tensor with rows of zeros appended up to `rows` (all-zero bytes are the value 0 in every GGUF type)."""
        extra = rows - self.shape[0]
        if extra < 0:
            raise ValueError(f"cannot pad {self.shape[0]} rows{_where(self.name)} to {rows}")
        if extra == 0:
            return self
        zeros = self.data.new_zeros((extra, *self.data.shape[1:]))
        return QTensor(torch.cat([self.data, zeros]), self.qtype, (rows, *self.shape[1:]), self.name)

    def to(self, device: torch.device | str) -> QTensor:
        """The same tensor with its data on `device` (self if already there)."""
        data = self.data.to(device)
        if data is self.data:
            return self
        return QTensor(data, self.qtype, self.shape, self.name)

    @classmethod
    def from_reader_tensor(cls, t: gguf.ReaderTensor) -> QTensor:
        """Wrap a `gguf.GGUFReader` tensor, zero-copy over the file's memory map."""
        qtype = check_supported(t.tensor_type, t.name)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        return cls(_from_numpy(t.data), qtype, shape, t.name)


def concat_rows(parts: list[QTensor]) -> QTensor | None:
    """The parts' rows stacked into a new tensor (one copy) when they share a type and row width, else None."""
    if len({p.qtype for p in parts}) != 1 or len({p.shape[1:] for p in parts}) != 1:
        return None
    data = torch.cat([p.data for p in parts], dim=0)
    return QTensor(data, parts[0].qtype, (sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].name)
