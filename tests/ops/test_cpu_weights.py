"""The CPU fast path's weight formats (`gpullama.ops.cpu_weights`) against gguf's dequantizer, the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpullama.ops import cpu_weights
from gpullama.ops.cpu_weights import DenseWeight, Int4Weight, int4_parts, prepare_cpu_weight, q6_k_groups
from gpullama.quants import QTensor
from tests.fixtures.quant_blocks import random_blocks, random_float_tensor

Q = gguf.GGMLQuantizationType
ROWS, COLS = 40, 512  # 40 rows: not a multiple of the kernel's 16/64-row blocks, so the padding is exercised
INT4_KERNEL_TYPES = cpu_weights.INT4_TYPES + cpu_weights.SPLIT_TYPES + cpu_weights.PAIRED_TYPES

pytestmark = pytest.mark.skipif(not cpu_weights.has_int4_kernel(), reason="this torch has no int4 CPU matmul")


def weight_and_reference(qtype: gguf.GGMLQuantizationType, rows: int = ROWS, cols: int = COLS, seed: int = 0):
    """(QTensor of random valid data, gguf's float32 dequantization of it ``[rows, cols]``)."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        raw = random_float_tensor(qtype, rows, cols, seed)
    else:
        raw = random_blocks(qtype, rows, cols, seed)
    reference = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
    return QTensor(torch.from_numpy(raw), qtype, (rows, cols)), torch.from_numpy(reference)


@pytest.mark.parametrize("qtype", cpu_weights.INT4_TYPES + cpu_weights.SPLIT_TYPES, ids=lambda t: t.name)
def test_int4_parts_sum_to_the_dequantized_values_exactly(qtype) -> None:
    """Before any bfloat16 rounding, the parts' ``(q - 8) * scale + zero`` add up to gguf's values, bit for bit."""
    weight, reference = weight_and_reference(qtype)
    parts = int4_parts(weight)
    assert len(parts) == (2 if qtype in cpu_weights.SPLIT_TYPES else 1)
    total = torch.zeros(ROWS, COLS)
    for q, scale, zero in parts:
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        total += (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    assert torch.equal(total, reference)


def test_q6_k_groups_give_the_dequantized_values() -> None:
    """Q6_K's paired groups, fed ``[x_16 | 16 x_16]``, weigh each input by gguf's value (float32, no rounding)."""
    weight, reference = weight_and_reference(Q.Q6_K)
    q, scale, zero = q6_k_groups(weight)
    per_slot = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    pairs = per_slot.view(ROWS, -1, 2, 16)
    effective = (pairs[:, :, 0] + 16 * pairs[:, :, 1]).reshape(ROWS, COLS)
    assert torch.allclose(effective, reference, rtol=1e-6, atol=1e-6 * reference.abs().max().item())


@pytest.mark.parametrize("qtype", [*INT4_KERNEL_TYPES, Q.F16, Q.BF16, Q.F32], ids=lambda t: t.name)
def test_cpu_weight_matches_gguf_dequantize(qtype) -> None:
    """The prepared weight, multiplied by the identity, gives gguf's values within bfloat16 rounding of the
    scales, zeros and result: 1/64 of the largest value of the row's block plus 1/256 of the value itself."""
    weight, reference = weight_and_reference(qtype)
    prepared = prepare_cpu_weight(weight, packed_linear=True)
    assert isinstance(prepared, Int4Weight if qtype in INT4_KERNEL_TYPES else DenseWeight)
    got = prepared.matmul(torch.eye(COLS, dtype=torch.bfloat16)).float().T
    assert got.shape == reference.shape
    block = 16 if qtype == Q.Q6_K else 32
    block_max = reference.abs().view(ROWS, -1, block).amax(-1, keepdim=True).expand(-1, -1, block).reshape(ROWS, COLS)
    excess = (got - reference).abs() - (block_max / 64 + reference.abs() / 256)
    assert excess.max() <= 0, f"{qtype.name}: worst excess {excess.max():.3g}"


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_int4_rows_do_not_depend_on_the_batch(qtype) -> None:
    """Each output row is bitwise the same computed alone or among 1 to 300 rows (batch-invariant)."""
    weight, _ = weight_and_reference(qtype, rows=96, cols=256)
    prepared = prepare_cpu_weight(weight, packed_linear=True)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    alone = torch.cat([prepared.matmul(x[i : i + 1]) for i in range(0, 300, 7)])
    for batch in (2, 5, 16, 33, 64, 300):
        together = prepared.matmul(x[:batch])
        assert torch.equal(together[::7], alone[: len(range(0, batch, 7))]), f"batch {batch}"


def test_packing_in_row_chunks_matches_one_chunk(monkeypatch) -> None:
    """A matrix packed a few rows at a time (as large ones are) computes the same as one packed whole."""
    weight, _ = weight_and_reference(Q.Q4_K, rows=200, cols=256)
    whole = Int4Weight.from_qtensor(weight)
    monkeypatch.setattr(cpu_weights, "_CHUNK_ROWS", 64)
    chunked = Int4Weight.from_qtensor(weight)
    x = torch.randn(3, 256).to(torch.bfloat16)
    assert torch.equal(whole.matmul(x), chunked.matmul(x))
    assert torch.equal(whole.packed, chunked.packed)


def test_float_matrix_and_odd_width_stay_dense() -> None:
    """Rows that are not whole groups of 32 cannot use the int4 kernel: they become dense bfloat16."""
    weight = QTensor(torch.randn(24, 48), Q.F32, (24, 48))
    prepared = prepare_cpu_weight(weight, packed_linear=False)
    assert isinstance(prepared, DenseWeight)
    x = torch.randn(2, 48).to(torch.bfloat16)
    assert torch.allclose(prepared.matmul(x).float(), x.float() @ weight.data.T, rtol=2e-2, atol=5e-2)
