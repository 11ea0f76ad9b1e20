"""gpullama.quants against gguf's own dequantizers (the reference), on random blocks and the real model file."""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES

from gpullama import quants
from gpullama.quants import QTensor
from tests.fixtures.quant_blocks import (
    FLOAT_TYPES,
    QUANTIZED_TYPES,
    SCALE_FIELDS,
    random_blocks,
    random_float_tensor,
)

Q = gguf.GGMLQuantizationType

# (rows, blocks per row): odd row counts and several blocks per row
SHAPES = [(1, 1), (3, 2), (7, 3), (4, 5)]


def _raw(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    if qtype in FLOAT_TYPES:
        return random_float_tensor(qtype, rows, cols, seed)
    return random_blocks(qtype, rows, cols, seed)


def _assert_matches_gguf(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, got: torch.Tensor) -> None:
    want = gguf.quants.dequantize(raw, qtype)
    assert got.dtype == torch.float32
    assert tuple(got.shape) == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=0)


def test_supported_types() -> None:
    assert quants.SUPPORTED_TYPES == {
        Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4
    }
    assert set(QUANTIZED_TYPES) | set(FLOAT_TYPES) == quants.SUPPORTED_TYPES
    for qtype in quants.SUPPORTED_TYPES:
        assert (quants.block_size(qtype), quants.type_size(qtype)) == GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks_per_row", SHAPES)
def test_dequantize_matches_gguf(qtype: gguf.GGMLQuantizationType, rows: int, blocks_per_row: int) -> None:
    bs = GGML_QUANT_SIZES[qtype][0]
    cols = blocks_per_row * (bs if bs > 1 else 32)
    raw = _raw(qtype, rows, cols, seed=rows * 100 + blocks_per_row)
    assert raw.shape[0] == rows and raw.nbytes == rows * cols // bs * GGML_QUANT_SIZES[qtype][1]
    assert np.isfinite(gguf.quants.dequantize(raw, qtype)).all()  # the fixture makes valid data
    got = quants.dequantize(torch.from_numpy(raw), qtype, (rows, cols))
    _assert_matches_gguf(raw, qtype, got)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_block_functions_take_any_leading_shape(qtype: gguf.GGMLQuantizationType) -> None:
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 6, 2 * bs, seed=5)  # 12 blocks
    fn = getattr(quants, f"dequantize_{qtype.name.lower()}")
    got = fn(torch.from_numpy(raw).reshape(2, 3, 2, ts))
    assert got.shape == (2, 3, 2, bs)
    want = gguf.quants.dequantize(raw, qtype).reshape(2, 3, 2, bs)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_scale_edge_values(qtype: gguf.GGMLQuantizationType) -> None:
    """Every f16 scale field set to subnormals, +-0, tiny and large finite values: still exact."""
    bs, _ = GGML_QUANT_SIZES[qtype]
    edge = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 6.1e-5, -1.5e-3, 1.0, -2.0, 65504.0, -65504.0, 0.33], dtype=np.float16)
    raw = random_blocks(qtype, len(edge), bs, seed=11)
    for k, (offset, _, _) in enumerate(SCALE_FIELDS[qtype]):
        raw[:, offset : offset + 2] = np.roll(edge, k).reshape(-1, 1).view(np.uint8)
    got = quants.dequantize(torch.from_numpy(raw), qtype, (len(edge), bs))
    want = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")  # gguf's own reference at exponent 254
def test_mxfp4_exponent_edges() -> None:
    """MXFP4's E8M0 exponent at its ends (0 and 1 give subnormal scales, 254 the largest finite one): gguf's
    values exactly."""
    raw = random_blocks(Q.MXFP4, 6, 64, seed=12)
    raw[:, 0] = np.array([0, 1, 2, 126, 127, 254], dtype=np.uint8)
    got = quants.dequantize(torch.from_numpy(raw), Q.MXFP4, (6, 64))
    want = gguf.quants.dequantize(raw, Q.MXFP4)
    np.testing.assert_array_equal(got.numpy(), want)


def test_bf16_accepts_raw_bytes_int16_and_typed() -> None:
    raw = random_float_tensor(Q.BF16, 3, 64, seed=2)  # uint8 [3, 128], as GGUFReader gives it
    want = gguf.quants.dequantize(raw, Q.BF16)
    as_int16 = torch.from_numpy(raw.view(np.int16))
    typed = torch.from_numpy(raw).view(torch.bfloat16)
    for data in (torch.from_numpy(raw), as_int16, typed):
        qt = QTensor(data, Q.BF16, (3, 64))
        assert qt.data.dtype == torch.bfloat16 and qt.data.shape == (3, 64)
        np.testing.assert_array_equal(qt.dequantize().numpy(), want)
    assert qt.dequantize(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_take_rows_matches_dequantize_then_index(qtype: gguf.GGMLQuantizationType) -> None:
    bs = GGML_QUANT_SIZES[qtype][0]
    cols = 2 * (bs if bs > 1 else 32)
    raw = _raw(qtype, 7, cols, seed=3)
    qt = QTensor(torch.from_numpy(raw), qtype, (7, cols))
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    index = torch.tensor([6, 0, 3, 3, 1])
    taken = qt.take_rows(index)
    assert taken.qtype == qtype and taken.shape == (5, cols)
    assert taken.nbytes == 5 * qt.nbytes // 7
    torch.testing.assert_close(taken.dequantize(), want[index], rtol=0, atol=0)
    index2d = torch.tensor([[1, 2], [5, 6]], dtype=torch.int32)
    torch.testing.assert_close(qt.take_rows(index2d).dequantize(), want[index2d.long()], rtol=0, atol=0)


def test_qtensor_layout_nbytes_and_to() -> None:
    raw = random_blocks(Q.Q4_K, 3, 512, seed=4)
    qt = QTensor(torch.from_numpy(raw), Q.Q4_K, (3, 512))
    assert qt.data.shape == (3, 288) and qt.nbytes == 3 * 288 == raw.nbytes
    assert qt.to("cpu") is qt
    moved = qt.to(torch.device("meta"))
    assert moved.data.device.type == "meta" and moved.shape == qt.shape and moved.qtype == qt.qtype
    # flat raw bytes are reshaped to [rows, bytes_per_row]
    flat = QTensor(torch.from_numpy(raw.reshape(-1)), Q.Q4_K, (3, 512))
    assert flat.data.shape == (3, 288)


def test_dequantize_returns_new_memory_for_f32() -> None:
    data = torch.from_numpy(random_float_tensor(Q.F32, 2, 8, seed=1))
    out = quants.dequantize(data, Q.F32, (2, 8))
    assert out.data_ptr() != data.data_ptr()
    torch.testing.assert_close(out, data, rtol=0, atol=0)


def test_wrong_byte_count_raises_with_names() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q4_0, 4, 64, seed=0))  # 4 x 36 bytes
    with pytest.raises(ValueError, match=r"Q4_0.*'blk\.3\.ffn_up\.weight'.*needs 180 bytes, got 144"):
        QTensor(raw, Q.Q4_0, (5, 64), name="blk.3.ffn_up.weight")
    with pytest.raises(ValueError, match=r"Q4_0.*'w'.*needs 72 bytes, got 144"):
        quants.dequantize(raw, Q.Q4_0, (2, 64), name="w")
    with pytest.raises(ValueError, match=r"row length 48.*'w'.*Q4_0 block size 32"):
        quants.dequantize(raw, Q.Q4_0, (3, 48), name="w")
    with pytest.raises(ValueError, match=r"F16 data.*dtype float32"):
        quants.dequantize(torch.zeros(2, 8), Q.F16, (2, 8))
    with pytest.raises(ValueError, match=r"F32 data.*needs 64 bytes, got 32"):
        QTensor(torch.zeros(2, 4), Q.F32, (2, 8))


def test_unsupported_type_raises_with_names() -> None:
    msg = r"unsupported tensor type IQ2_XXS for tensor 'blk\.0\.attn_q\.weight'"
    with pytest.raises(ValueError, match=msg):
        quants.block_size(Q.IQ2_XXS, "blk.0.attn_q.weight")
    with pytest.raises(ValueError, match=r"unsupported tensor type Q3_K"):
        quants.type_size(Q.Q3_K)
    with pytest.raises(ValueError, match=msg):
        quants.dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, (1, 256), name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match=r"unsupported tensor type Q2_K for tensor 'x'"):
        QTensor(torch.zeros(84, dtype=torch.uint8), Q.Q2_K, (1, 256), name="x")


def test_take_rows_bad_index() -> None:
    qt = QTensor(torch.from_numpy(random_blocks(Q.Q8_0, 3, 32, seed=0)), Q.Q8_0, (3, 32), name="token_embd.weight")
    with pytest.raises(ValueError, match=r"'token_embd\.weight'.*out of range \[0, 3\)"):
        qt.take_rows(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"integer index"):
        qt.take_rows(torch.tensor([0.0]))


@pytest.fixture(scope="module")
def reader(default_model_path: Path) -> gguf.GGUFReader:
    """The real default model (SmolLM2-135M-Instruct Q4_1: Q8_0 embedding, Q4_1 matrices, F32 norms)."""
    return gguf.GGUFReader(default_model_path)


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight"])
def test_real_model_tensors_match_gguf(reader: gguf.GGUFReader, name: str) -> None:
    t = next(t for t in reader.tensors if t.name == name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the read-only mmap warning must be silenced inside
        qt = QTensor.from_reader_tensor(t)
    assert qt.name == name and qt.qtype == t.tensor_type
    assert qt.shape == tuple(reversed(t.shape.tolist()))
    assert qt.data.data_ptr() == t.data.ctypes.data  # zero-copy over the memory map
    assert qt.nbytes == t.n_bytes
    np.testing.assert_array_equal(qt.dequantize().numpy(), gguf.quants.dequantize(t.data, t.tensor_type))
    if len(qt.shape) == 2:
        index = torch.tensor([qt.shape[0] - 1, 0, 17])
        np.testing.assert_array_equal(
            qt.take_rows(index).dequantize().numpy(), gguf.quants.dequantize(t.data[index.numpy()], t.tensor_type)
        )


def test_real_model_types(reader: gguf.GGUFReader) -> None:
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == Q.Q8_0 and types["blk.0.ffn_down.weight"] == Q.Q4_1
    assert set(types.values()) <= quants.SUPPORTED_TYPES
