"""GGUF block layouts decoded in registers: `dequantize_tile` turns raw bytes into a float32 tile.

A quantized weight is uint8 ``[rows, bytes_per_row]``: each row is a run of blocks of QK values. The kernels
address element (row, col) as byte ``row * row_bytes + (col // QK) * TYPE_SIZE + field offset``; f16 fields sit
at even offsets of blocks of even size, so they are read through a float16 view of the same bytes.

    F32/F16/BF16  the typed matrix itself                                        w = x
    Q8_0  32 values,  34 bytes: d f16 | qs int8[32]                               w = d * q
    Q4_0  32 values,  18 bytes: d f16 | qs[16] (value j: nibble j%16, low nibble first half)   w = d * (q - 8)
    Q4_1  32 values,  20 bytes: d f16 | m f16 | qs[16]                            w = d * q + m
    Q5_0  32 values,  22 bytes: d f16 | qh u32 (bit j = 5th bit of value j) | qs[16]   w = d * (q - 16)
    Q5_1  32 values,  24 bytes: d f16 | m f16 | qh u32 | qs[16]                   w = d * q + m
    Q4_K  256 values, 144 bytes: d f16 | dmin f16 | scales[12] (8 x 6-bit scale, 8 x 6-bit min) | qs[128]
          value e (0..255): sub-block s = e // 32, byte 32 * (s // 2) + e % 32, nibble s % 2;
          w = d * scale[s] * q - dmin * min[s]
    Q5_K  256 values, 176 bytes: d | dmin | scales[12] | qh[32] (bit s of qh[e % 32]) | qs[128]   as Q4_K, q += 16 * bit
    Q6_K  256 values, 210 bytes: ql[128] | qh[64] | scales int8[16] | d f16; half h = e // 128, r = e % 128:
          low nibble of ql[64h + r % 64] (high nibble if r >= 64), 2 bits (r // 32) of qh[32h + r % 32];
          w = d * scales[e // 16] * (q - 32)
    MXFP4 32 values,  17 bytes: e u8 (E8M0) | qs[16] (value j: nibble j%16, low nibble first half);
          q's bit 3 the sign, bits 0-2 an E2M1 magnitude m (doubled: m < 2: m, else (2 + m % 2) << (m // 2 - 1));
          w = 2^(e - 128) * value  (no f16 field: rows may start at odd offsets)
Torch reference: `gpullama.quants.dequantize` (and `gguf.quants.dequantize`).
"""

from __future__ import annotations

import gguf
import torch
import triton
import triton.language as tl

Q = gguf.GGMLQuantizationType

# Types the kernels read directly; the constexpr FMT of a kernel is the GGML type id.
QUANTIZED_KERNEL_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4)
DENSE_FORMATS = {torch.float32: int(Q.F32), torch.float16: int(Q.F16), torch.bfloat16: int(Q.BF16)}


def weight_pointers(data: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The (bytes, float16 view, row stride) a kernel reads a quantized weight through."""
    if qtype not in QUANTIZED_KERNEL_TYPES:
        raise ValueError(f"no Triton dequantizer for type {qtype.name}")
    if data.dtype != torch.uint8 or data.dim() != 2 or data.stride(1) != 1:
        raise ValueError(f"quantized weight data must be uint8 [rows, bytes] with unit column stride, got {data.dtype} {tuple(data.shape)}")
    if qtype == Q.MXFP4:  # no f16 field: the bytes serve as both views
        return data, data, data.stride(0)
    if data.stride(0) % 2 or data.shape[1] % 2:
        raise ValueError(f"quantized weight rows must start at even byte offsets, got row stride {data.stride(0)}")
    return data, data.view(torch.float16), data.stride(0)


@triton.jit
def _f16_at(h_ptr, byte_offset, mask):
    """The f16 field at an even byte offset, as float32."""
    return tl.load(h_ptr + byte_offset // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _u8_at(u8_ptr, byte_offset, mask):
    """The byte at an offset, as int32."""
    return tl.load(u8_ptr + byte_offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(u8_ptr, scales_offset, s, mask):
    """6-bit scale and min of sub-block `s` (0..7) from the 12 packed bytes of a Q4_K / Q5_K block."""
    low = s % 4
    a = _u8_at(u8_ptr, scales_offset + low, mask)  # scales[s] (s < 4) or scales[s - 4]
    b = _u8_at(u8_ptr, scales_offset + 4 + low, mask)  # scales[s + 4] (s < 4) or scales[s]
    c = _u8_at(u8_ptr, scales_offset + 8 + low, mask)  # scales[s + 4] (s >= 4)
    scale = tl.where(s < 4, a & 63, (c & 0xF) | ((a >> 6) << 4))
    minimum = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


def sub_block_size(fmt: int) -> int:
    """Values that share one scale in format `fmt` (the innermost tile dim): 16 for Q6_K, 32 otherwise."""
    return 16 if fmt == int(Q.Q6_K) else 32


@triton.jit
def dequantize_tile(w_ptr, h_ptr, rows, sub, lane, row_stride, row_mask, K, FMT: tl.constexpr, SUB: tl.constexpr):
    """Float32 weights at rows ``[R, 1, 1]`` x columns ``sub * SUB + lane`` (``sub [1, S, 1]``, ``lane [1, 1, SUB]``).

    A tile is ``[R, S, SUB]``: S sub-blocks of SUB values that share their scales, so the scale fields are read
    and decoded once per ``[R, S, 1]`` sub-block and broadcast. `w_ptr` is the typed matrix for F32/F16/BF16
    (`row_stride` in elements) or its bytes (`row_stride` in bytes, `h_ptr` the float16 view of the same
    bytes). `row_mask` is ``[R, 1, 1]``; values of masked rows and of columns >= K are 0.
    """
    rows = rows.to(tl.int64) * row_stride
    mask = row_mask & (sub * SUB + lane < K)  # [R, S, SUB]
    sub_mask = row_mask & (sub * SUB < K)  # [R, S, 1]: quantized rows hold whole sub-blocks
    if FMT == 0 or FMT == 1 or FMT == 30:  # F32, F16, BF16
        return tl.load(w_ptr + rows + sub * SUB + lane, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 8:  # Q8_0
        base = rows + sub * 34
        d = _f16_at(h_ptr, base, sub_mask)
        q = tl.load(w_ptr + base + 2 + lane, mask=mask, other=0).to(tl.int8, bitcast=True)
        return d * q.to(tl.float32)
    elif FMT == 2:  # Q4_0
        base = rows + sub * 18
        d = _f16_at(h_ptr, base, sub_mask)
        q = (_u8_at(w_ptr, base + 2 + lane % 16, mask) >> ((lane // 16) * 4)) & 0xF
        return d * (q - 8).to(tl.float32)
    elif FMT == 3:  # Q4_1
        base = rows + sub * 20
        d = _f16_at(h_ptr, base, sub_mask)
        m = _f16_at(h_ptr, base + 2, sub_mask)
        q = (_u8_at(w_ptr, base + 4 + lane % 16, mask) >> ((lane // 16) * 4)) & 0xF
        return d * q.to(tl.float32) + m
    elif FMT == 6:  # Q5_0
        base = rows + sub * 22
        d = _f16_at(h_ptr, base, sub_mask)
        high = (_u8_at(w_ptr, base + 2 + lane // 8, mask) >> (lane % 8)) & 1
        q = ((_u8_at(w_ptr, base + 6 + lane % 16, mask) >> ((lane // 16) * 4)) & 0xF) | (high << 4)
        return d * (q - 16).to(tl.float32)
    elif FMT == 7:  # Q5_1
        base = rows + sub * 24
        d = _f16_at(h_ptr, base, sub_mask)
        m = _f16_at(h_ptr, base + 2, sub_mask)
        high = (_u8_at(w_ptr, base + 4 + lane // 8, mask) >> (lane % 8)) & 1
        q = ((_u8_at(w_ptr, base + 8 + lane % 16, mask) >> ((lane // 16) * 4)) & 0xF) | (high << 4)
        return d * q.to(tl.float32) + m
    elif FMT == 12:  # Q4_K: sub-block s = sub % 8 of super-block sub // 8
        s = sub % 8
        base = rows + (sub // 8) * 144
        scale, minimum = _k_scale_min(w_ptr, base + 4, s, sub_mask)
        d = _f16_at(h_ptr, base, sub_mask) * scale
        dm = _f16_at(h_ptr, base + 2, sub_mask) * minimum
        q = (_u8_at(w_ptr, base + 16 + (s // 2) * 32 + lane, mask) >> ((s % 2) * 4)) & 0xF
        return d * q.to(tl.float32) - dm
    elif FMT == 13:  # Q5_K
        s = sub % 8
        base = rows + (sub // 8) * 176
        scale, minimum = _k_scale_min(w_ptr, base + 4, s, sub_mask)
        d = _f16_at(h_ptr, base, sub_mask) * scale
        dm = _f16_at(h_ptr, base + 2, sub_mask) * minimum
        high = (_u8_at(w_ptr, base + 16 + lane, mask) >> s) & 1
        q = ((_u8_at(w_ptr, base + 48 + (s // 2) * 32 + lane, mask) >> ((s % 2) * 4)) & 0xF) | (high << 4)
        return d * q.to(tl.float32) - dm
    elif FMT == 39:  # MXFP4
        base = rows + sub * 17
        e = _u8_at(w_ptr, base, sub_mask)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        q = (_u8_at(w_ptr, base + 1 + lane % 16, mask) >> ((lane // 16) * 4)) & 0xF
        m = q & 7
        magnitude = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
        return d * tl.where(q >= 8, -magnitude, magnitude).to(tl.float32)
    else:  # Q6_K (FMT == 14), SUB == 16: sub-block s = sub % 16 of super-block sub // 16
        tl.static_assert(FMT == 14)
        s = sub % 16
        base = rows + (sub // 16) * 210
        scale = tl.load(w_ptr + base + 192 + s, mask=sub_mask, other=0).to(tl.int8, bitcast=True)
        d = _f16_at(h_ptr, base + 208, sub_mask) * scale.to(tl.float32)
        half = s // 8
        r = (s % 8) * 16 + lane  # position in the half, 0..127
        low = (_u8_at(w_ptr, base + 64 * half + r % 64, mask) >> ((r // 64) * 4)) & 0xF
        high = (_u8_at(w_ptr, base + 128 + 32 * half + r % 32, mask) >> ((r // 32) * 2)) & 3
        return d * ((low | (high << 4)) - 32).to(tl.float32)
