"""The CPU fast path's weight formats (`gpullama.ops.cpu_weights`) against gguf's dequantizer, the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpullama.kernels import cpu_native
from gpullama.ops import cpu_weights
from gpullama.ops.cpu_weights import CpuWeight, packable
from gpullama.quants import QTensor
from tests.fixtures.quant_blocks import random_blocks, random_float_tensor

Q = gguf.GGMLQuantizationType
ROWS, COLS = 40, 512  # 40 rows: not a multiple of the kernels' 16-row blocks, so the padding is exercised
QUANTIZED = cpu_weights.QUANTIZED_TYPES
FLOATS = (Q.F16, Q.BF16, Q.F32)

needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")


def weight_and_reference(qtype: gguf.GGMLQuantizationType, rows: int = ROWS, cols: int = COLS, seed: int = 0):
    """(QTensor of random valid data, gguf's float32 dequantization of it ``[rows, cols]``)."""
    raw = random_float_tensor(qtype, rows, cols, seed) if qtype in FLOATS else random_blocks(qtype, rows, cols, seed)
    reference = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
    return QTensor(torch.from_numpy(raw), qtype, (rows, cols)), torch.from_numpy(reference)


def rounded_input(x: torch.Tensor, bits: int = 16, qtype: gguf.GGMLQuantizationType | None = None) -> torch.Tensor:
    """x as the quantized matmul sees it: each 32 values rounded to multiples of their largest magnitude / 32258
    (16-bit activations), or / 127 (8-bit ones, as llama.cpp's Q8_0 rounds them); 8-bit ones for a K-quant `qtype`
    each 256 values by their largest magnitude / 127 (as llama.cpp's Q8_K)."""
    top = 32258 if bits == 16 else 127
    span = 256 if bits == 8 and qtype in cpu_weights.K_QUANTS else 32
    groups = x.view(x.shape[0], -1, span)
    amax = groups.abs().amax(-1, keepdim=True)
    # top / amax as the kernel divides (torch computes a number over a tensor as its reciprocal times the number,
    # an ulp away, which can move a value near a half to the other integer)
    q = torch.where(amax > 0, torch.round(groups * (torch.tensor(float(top)) / amax)), 0)
    return (q * (amax / top)).view_as(x)


GGUF_MATRIX_BYTES = {qtype: gguf.GGML_QUANT_SIZES[qtype][1] / gguf.GGML_QUANT_SIZES[qtype][0] for qtype in QUANTIZED}


@needs_kernels
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_packed_bytes_are_the_gguf_bytes(qtype) -> None:
    """Bytes a weight: the file's for the legacy types, Q6_K and MXFP4, within 3% for Q4_K/Q5_K (their 6-bit
    scales held as bytes)."""
    weight, _ = weight_and_reference(qtype, rows=64)
    per_weight = CpuWeight.from_qtensor(weight).nbytes / (64 * COLS)
    if qtype in (Q.Q4_K, Q.Q5_K):
        assert GGUF_MATRIX_BYTES[qtype] < per_weight < 1.03 * GGUF_MATRIX_BYTES[qtype]
    else:
        assert per_weight == GGUF_MATRIX_BYTES[qtype]


@needs_kernels
@pytest.mark.parametrize("qtype", [*QUANTIZED, *FLOATS], ids=lambda t: t.name)
def test_packed_rows_read_back_exactly(qtype) -> None:
    """The embedding lookup reads any row of the packed matrix back as gguf's values, bit for bit."""
    weight, reference = weight_and_reference(qtype)
    packed = CpuWeight.from_qtensor(weight)
    ids = torch.tensor([0, 39, 17, 16, 15, 3])
    got = cpu_native.embedding(packed.fmt, packed.blocks, ROWS, ids, torch.empty(len(ids), COLS))
    assert torch.equal(got, reference[ids])
    with pytest.raises(ValueError, match="out of range"):
        cpu_native.embedding(packed.fmt, packed.blocks, ROWS, torch.tensor([ROWS]), torch.empty(1, COLS))


@needs_kernels
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", [*QUANTIZED, *FLOATS], ids=lambda t: t.name)
def test_matmul_is_the_dot_product_with_the_rounded_input(qtype, bits) -> None:
    """Quantized formats: exactly ``rounded_input(x, bits) @ W.T`` up to float32 summation (1e-6 of the sum of
    |terms|), with 16-bit and with 8-bit activations; float formats: ``x @ W.T`` (`bits` unused)."""
    weight, reference = weight_and_reference(qtype)
    x = torch.randn(9, COLS, generator=torch.Generator().manual_seed(1))
    seen = x if qtype in FLOATS else rounded_input(x, bits, qtype)
    want = seen.double() @ reference.double().T
    size = seen.double().abs() @ reference.double().abs().T
    got = CpuWeight.from_qtensor(weight).matmul(x, bits)
    assert got.shape == (9, ROWS)
    assert ((got.double() - want).abs() / size).max() < 1e-6


@needs_kernels
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_prefill_in_row_chunks_and_k_slices_is_the_dot_product(qtype, bits) -> None:
    """A prefill's matmul (more than 128 rows, K past 4096 values: the kernel's row chunks and K slices, its sums
    carried through y between slices) is still ``rounded_input(x, bits) @ W.T``, and each row the same as alone."""
    weight, reference = weight_and_reference(qtype, rows=32, cols=4608)
    x = torch.randn(140, 4608, generator=torch.Generator().manual_seed(4))
    seen = rounded_input(x, bits, qtype).double()
    packed = CpuWeight.from_qtensor(weight)
    got = packed.matmul(x, bits)
    assert ((got.double() - seen @ reference.double().T).abs() / (seen.abs() @ reference.double().abs().T)).max() < 1e-6
    assert torch.equal(got[137:], packed.matmul(x[137:], bits)) and torch.equal(got[5:6], packed.matmul(x[5:6], bits))


@needs_kernels
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4, Q.F16], ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_batch_or_the_threads(qtype, bits) -> None:
    """Each output row is bitwise the same computed alone or among 1 to 300 rows, on 1 thread or 2 (16-bit and
    8-bit activations)."""
    weight, _ = weight_and_reference(qtype, rows=96, cols=256)
    packed = CpuWeight.from_qtensor(weight)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([packed.matmul(x[i : i + 1], bits) for i in range(0, 300, 7)])
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for batch in (2, 5, 8, 9, 16, 33, 300):
                together = packed.matmul(x[:batch], bits)
                assert torch.equal(together[::7], alone[: len(range(0, batch, 7))]), f"batch {batch}"
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_packing_is_the_same_on_one_thread_or_two_and_pads_with_zero_rows(qtype) -> None:
    """`gl_repack` splits the 16-row groups between threads: one thread or two write the same bytes; the rows
    added to fill the last group read back as zeros."""
    weight, reference = weight_and_reference(qtype, rows=200, cols=512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = CpuWeight.from_qtensor(weight).blocks
        torch.set_num_threads(2)
        two = CpuWeight.from_qtensor(weight).blocks
    finally:
        torch.set_num_threads(threads)
    assert one.shape[0] == 13 and torch.equal(one, two)
    got = cpu_native.embedding(cpu_weights.NATIVE_FORMATS[qtype], one, 208, torch.arange(190, 208),
                               torch.empty(18, 512))
    assert torch.equal(got[:10], reference[190:]) and not got[10:].any()


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_joined_parts_pack_as_one_matrix_of_their_rows(qtype) -> None:
    """q|k|v or gate|up packed from where each part lies (`CpuWeight.from_parts`, no joined copy), with part sizes
    that are not multiples of 16: the rows read back as gguf's values of each part, in order, and the matmul is
    the dot product with every part's rows."""
    sizes = (40, 24, 9)
    pairs = [weight_and_reference(qtype, rows=n, cols=256, seed=i) for i, n in enumerate(sizes)]
    reference = torch.cat([r for _, r in pairs])
    packed = CpuWeight.from_parts([w for w, _ in pairs])
    assert (packed.out_features, packed.in_features) == (73, 256)
    got = cpu_native.embedding(packed.fmt, packed.blocks, 73, torch.arange(73), torch.empty(73, 256))
    assert torch.equal(got, reference)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    want = rounded_input(x).double() @ reference.double().T
    size = rounded_input(x).double().abs() @ reference.double().abs().T
    assert ((packed.matmul(x).double() - want).abs() / size).max() < 1e-6


@needs_kernels
def test_mxfp4_exponents_at_their_ends_read_back_exactly() -> None:
    """MXFP4's E8M0 exponent bytes 0 and 1 (subnormal scales), 2, 127 and 254-255 (the largest): the packed rows
    read back as gguf's values, bit for bit, and a matmul by the small ones stays exact."""
    weight, _ = weight_and_reference(Q.MXFP4, rows=16, cols=64)
    raw = weight.data.clone()
    for row, e in enumerate((0, 1, 2, 127, 254, 255, 0, 1, 2, 3, 120, 130, 200, 60, 1, 0)):
        raw[row, 0] = e  # the first block's exponent byte of each row
    with np.errstate(over="ignore"):  # exponent 255 times the largest values: inf, in gguf's float32 as in ours
        reference = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.MXFP4).astype(np.float32).reshape(16, 64))
    packed = CpuWeight.from_qtensor(QTensor(raw, Q.MXFP4, (16, 64)))
    got = cpu_native.embedding(packed.fmt, packed.blocks, 16, torch.arange(16), torch.empty(16, 64))
    assert torch.equal(got, reference)
    small = [0, 1, 2, 6, 7, 8, 9, 14, 15]  # rows with no scale near float32's top
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    want = rounded_input(x).double() @ reference[small].double().T
    size = rounded_input(x).double().abs() @ reference[small].double().abs().T
    assert ((packed.matmul(x)[:, small].double() - want).abs() / size.clamp(min=1e-300)).max() < 1e-6


def test_what_has_a_cpu_format() -> None:
    assert packable(weight_and_reference(Q.Q4_K)[0])
    assert not packable(QTensor(torch.randn(24, 48), Q.F32, (24, 48)))  # rows not whole groups of 32
    assert not packable(QTensor(torch.randn(48), Q.F32, (48,)))
