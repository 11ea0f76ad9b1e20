"""The CPU fast path's weight formats (`gpullama.ops.cpu_weights`) against gguf's dequantizer, the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpullama.kernels import cpu_native
from gpullama.ops import cpu_weights
from gpullama.ops.cpu_weights import CpuWeight, packable, quantized_rows
from gpullama.quants import QTensor
from tests.fixtures.quant_blocks import random_blocks, random_float_tensor

Q = gguf.GGMLQuantizationType
ROWS, COLS = 40, 512  # 40 rows: not a multiple of the kernels' 16-row blocks, so the padding is exercised
QUANTIZED = cpu_weights.Q4_TYPES + cpu_weights.Q8_TYPES
FLOATS = (Q.F16, Q.BF16, Q.F32)

needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")


def weight_and_reference(qtype: gguf.GGMLQuantizationType, rows: int = ROWS, cols: int = COLS, seed: int = 0):
    """(QTensor of random valid data, gguf's float32 dequantization of it ``[rows, cols]``)."""
    raw = random_float_tensor(qtype, rows, cols, seed) if qtype in FLOATS else random_blocks(qtype, rows, cols, seed)
    reference = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
    return QTensor(torch.from_numpy(raw), qtype, (rows, cols)), torch.from_numpy(reference)


def rounded_input(x: torch.Tensor) -> torch.Tensor:
    """x as the quantized matmul sees it: each 32 values rounded to multiples of their largest magnitude / 32258."""
    groups = x.view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(groups * (32258 / amax)), 0)
    return (q * (amax / 32258)).view_as(x)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_unsigned_values_scales_and_zeros_give_gguf_values_exactly(qtype) -> None:
    """``u * scale + zero`` in one rounding (as the kernels compute it) equals gguf's value, bit for bit."""
    weight, reference = weight_and_reference(qtype)
    u, scale, zero = quantized_rows(weight, slice(None))
    assert u.dtype == torch.uint8 and int(u.max()) < (16 if qtype in cpu_weights.Q4_TYPES else 256)
    group = COLS // scale.shape[1]
    values = torch.addcmul(zero.repeat_interleave(group, 1), u.float(), scale.repeat_interleave(group, 1))
    fused = (u.double() * scale.repeat_interleave(group, 1).double() + zero.repeat_interleave(group, 1).double()).float()
    assert torch.equal(fused, reference)
    assert torch.allclose(values, reference, rtol=0, atol=1e-6 * reference.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("qtype", [*QUANTIZED, *FLOATS], ids=lambda t: t.name)
def test_packed_rows_read_back_exactly(qtype) -> None:
    """The embedding lookup reads any row of the packed matrix back as gguf's values, bit for bit."""
    weight, reference = weight_and_reference(qtype)
    packed = CpuWeight.from_qtensor(weight)
    ids = torch.tensor([0, 39, 17, 16, 15, 3])
    got = cpu_native.embedding(packed.fmt, packed.group, packed.half_scales, packed.blocks, ROWS, ids,
                               torch.empty(len(ids), COLS))
    assert torch.equal(got, reference[ids])
    with pytest.raises(ValueError, match="out of range"):
        cpu_native.embedding(packed.fmt, packed.group, packed.half_scales, packed.blocks, ROWS, torch.tensor([ROWS]),
                             torch.empty(1, COLS))


@needs_kernels
@pytest.mark.parametrize("qtype", [*QUANTIZED, *FLOATS], ids=lambda t: t.name)
def test_matmul_is_the_dot_product_with_the_rounded_input(qtype) -> None:
    """Quantized formats: exactly ``rounded_input(x) @ W.T`` up to float32 summation (1e-6 of the sum of |terms|);
    float formats: ``x @ W.T``."""
    weight, reference = weight_and_reference(qtype)
    x = torch.randn(9, COLS, generator=torch.Generator().manual_seed(1))
    seen = x if qtype in FLOATS else rounded_input(x)
    want = seen.double() @ reference.double().T
    size = seen.double().abs() @ reference.double().abs().T
    got = CpuWeight.from_qtensor(weight).matmul(x)
    assert got.shape == (9, ROWS)
    assert ((got.double() - want).abs() / size).max() < 1e-6


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K, Q.F16], ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_batch_or_the_threads(qtype) -> None:
    """Each output row is bitwise the same computed alone or among 1 to 300 rows, on 1 thread or 2."""
    weight, _ = weight_and_reference(qtype, rows=96, cols=256)
    packed = CpuWeight.from_qtensor(weight)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([packed.matmul(x[i : i + 1]) for i in range(0, 300, 7)])
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for batch in (2, 5, 8, 9, 16, 33, 300):
                together = packed.matmul(x[:batch])
                assert torch.equal(together[::7], alone[: len(range(0, batch, 7))]), f"batch {batch}"
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_packing_in_row_chunks_matches_one_chunk(monkeypatch) -> None:
    """A matrix packed a few rows at a time (as large ones are) is the same as one packed whole."""
    weight, _ = weight_and_reference(Q.Q4_K, rows=200, cols=256)
    whole = CpuWeight.from_qtensor(weight)
    monkeypatch.setattr(cpu_weights, "_CHUNK_ROWS", 64)
    assert torch.equal(whole.blocks, CpuWeight.from_qtensor(weight).blocks)


@needs_kernels
def test_scales_float16_cannot_hold_stay_float32() -> None:
    """Q4_0's zero is -8d: for d beyond float16's range / 8 the scales are kept as float32, still exact."""
    weight, reference = weight_and_reference(Q.Q4_0, rows=16, cols=64)
    raw = weight.data.clone()
    raw[3, 0:2] = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)  # d of row 3, block 0
    weight = QTensor(raw, Q.Q4_0, (16, 64))
    packed = CpuWeight.from_qtensor(weight)
    assert not packed.half_scales
    got = cpu_native.embedding(packed.fmt, packed.group, False, packed.blocks, 16, torch.arange(16),
                               torch.empty(16, 64))
    assert torch.equal(got, weight.dequantize())


def test_what_has_a_cpu_format() -> None:
    assert packable(weight_and_reference(Q.Q4_K)[0])
    assert not packable(QTensor(torch.randn(24, 48), Q.F32, (24, 48)))  # rows not whole groups of 32
    assert not packable(QTensor(torch.randn(48), Q.F32, (48,)))
