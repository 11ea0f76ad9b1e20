"""Bad input gives one clear ValueError naming the file, field or limit, raised from gpullama, not from deep inside."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.gguf_file import ModelFileError, read_gguf

Q = gguf.GGMLQuantizationType
HEADER_BYTES = 24  # magic, version, tensor count, metadata count


def assert_clear(excinfo: pytest.ExceptionInfo, *needles: str) -> str:
    """The error is a one-line ValueError holding every needle, raised without a chained library traceback."""
    exc = excinfo.value
    message = str(exc)
    assert isinstance(exc, ValueError), f"{type(exc).__name__} is not a ValueError: {message}"
    assert message and "\n" not in message, f"not one line: {message!r}"
    for needle in needles:
        assert needle in message, f"{needle!r} missing from: {message}"
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__), (
        f"the error chains a library exception: {exc.__context__!r}"
    )
    deep = [str(entry.path) for entry in excinfo.traceback if "site-packages" in str(entry.path)]
    assert not deep, f"raised from inside a library: {deep}"
    return message


def load(path: Path | str) -> LLM:
    """Load a model file the way a user does."""
    return LLM(str(path), device="cpu", dtype="float32")


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q | None]]) -> Path:
    """A small GGUF file with llama-style hyperparameters under `arch` and the given (data, raw_dtype) tensors."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def raw_blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Zeroed bytes of a `rows x cols` tensor of `qtype`, shaped as GGUFWriter expects raw quantized data."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return np.zeros((rows, cols // block * size), dtype=np.uint8)


# -- model files ------------------------------------------------------------------------------------------
def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.gguf"
    with pytest.raises(ModelFileError) as excinfo:
        load(path)
    assert_clear(excinfo, str(path), "not found")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError) as excinfo:
        load(tmp_path)
    assert_clear(excinfo, str(tmp_path), "directory")


@pytest.mark.parametrize("content", [b"", b"GG", b"hello, I am a text file and not a model\n" * 10, b"\x00" * 64])
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError) as excinfo:
        load(path)
    assert_clear(excinfo, str(path), "not a GGUF file")


CUTS = ("magic", "header", "first metadata key", "token list", "tensor infos", "one byte short")


@pytest.fixture(scope="module")
def cut_points(default_model_path: Path) -> dict[str, int]:
    """Byte counts that end inside each part of the real model file, located by gguf's reader."""
    reader = gguf.GGUFReader(default_model_path)
    fields = list(reader.fields.values())
    first_kv = fields[3].offset  # after GGUF.version, GGUF.tensor_count, GGUF.kv_count
    tokens = reader.fields["tokenizer.ggml.tokens"]
    tensor_infos = reader.tensors[0].field.offset
    data_end = max(t.data_offset + int(t.n_bytes) for t in reader.tensors)
    assert first_kv == HEADER_BYTES and first_kv < tokens.offset < tensor_infos < reader.data_offset < data_end
    cuts = {
        "magic": 2,
        "header": 12,
        "first metadata key": first_kv + 5,
        "token list": tokens.offset + 100_000,
        "tensor infos": tensor_infos + 20,
        "one byte short": data_end - 1,
    }
    assert tuple(cuts) == CUTS
    return cuts


def copy_head(src: Path, dst: Path, size: int) -> None:
    """Write the first `size` bytes of `src` to `dst`."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        left = size
        while left:
            chunk = fin.read(min(left, 1 << 22))
            fout.write(chunk)
            left -= len(chunk)


@pytest.mark.parametrize("where", CUTS)
def test_truncated_gguf(tmp_path: Path, default_model_path: Path, cut_points: dict[str, int], where: str) -> None:
    size = cut_points[where]
    path = tmp_path / f"cut-{size}.gguf"
    copy_head(default_model_path, path, size)
    assert path.stat().st_size == size
    with pytest.raises(ModelFileError) as excinfo:
        read_gguf(str(path))
    message = assert_clear(excinfo, str(path))
    if where != "magic":  # two bytes cannot even be recognised as GGUF
        assert "truncated" in message, f"cut inside the {where}: {message}"


def test_truncated_gguf_through_llm(tmp_path: Path, default_model_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    copy_head(default_model_path, path, 1000)
    with pytest.raises(ModelFileError) as excinfo:
        load(path)
    assert_clear(excinfo, str(path), "truncated")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gptx.gguf", "gptx", {"token_embd.weight": (np.zeros((32, 256), np.float32), None)})
    with pytest.raises(ValueError) as excinfo:
        load(path)
    assert_clear(excinfo, str(path), "gptx", "architecture")


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.IQ2_XXS, Q.Q3_K, Q.IQ4_NL])
def test_unsupported_tensor_type(tmp_path: Path, qtype: Q) -> None:
    tensors = {
        "token_embd.weight": (np.zeros((32, 256), np.float32), None),
        "blk.0.ffn_down.weight": (raw_blocks(qtype, 256, 256), qtype),
    }
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", "llama", tensors)
    with pytest.raises(ValueError) as excinfo:
        load(path)
    assert_clear(excinfo, str(path), qtype.name, "blk.0.ffn_down.weight")


# -- load options ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float8", "fp32", "int8", ""])
def test_unknown_dtype(default_model_path: Path, dtype: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        LLM(str(default_model_path), device="cpu", dtype=dtype)
    assert_clear(excinfo, "dtype", repr(dtype))


@pytest.mark.parametrize("device", ["banana", "tpu", "gpu", "mps"])
def test_unknown_device(default_model_path: Path, device: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        LLM(str(default_model_path), device=device, dtype="float32")
    assert_clear(excinfo, "device", device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
def test_cuda_without_a_gpu(default_model_path: Path) -> None:
    with pytest.raises(ValueError) as excinfo:
        LLM(str(default_model_path), device="cuda", dtype="float32")
    assert_clear(excinfo, "cuda")


# -- requests against the context ----------------------------------------------------------------------
def test_prompt_longer_than_the_context(short_bf16_llm: LLM) -> None:
    llm = short_bf16_llm
    prompt = "one two three four five six seven eight nine ten " * 10
    n = len(llm.tokenizer.encode(prompt, add_special_tokens=True))
    assert n > 64
    for call in (
        lambda: llm.generate(prompt, SamplingParams(max_tokens=1)),
        lambda: llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=1)),
        lambda: next(llm.stream(prompt, SamplingParams(max_tokens=1))),
    ):
        with pytest.raises(ValueError) as excinfo:
            call()
        message = assert_clear(excinfo, "64", "context")
        assert any(str(k) in message for k in range(n, n + 40)), message  # chat adds template tokens


def test_prompt_exactly_at_the_context_leaves_no_room(short_bf16_llm: LLM) -> None:
    ids = [short_bf16_llm.tokenizer.encode(" the")[0]] * 64
    with pytest.raises(ValueError) as excinfo:
        short_bf16_llm.generate(ids, SamplingParams(max_tokens=1))
    assert_clear(excinfo, "64")


def test_prompt_plus_max_tokens_beyond_the_context(short_bf16_llm: LLM) -> None:
    llm = short_bf16_llm
    prompt = "one two three four five six seven eight nine ten " * 4
    n = len(llm.tokenizer.encode(prompt, add_special_tokens=True))
    assert 30 < n < 64 - 1
    with pytest.raises(ValueError) as excinfo:
        llm.generate(prompt, SamplingParams(max_tokens=40))
    assert_clear(excinfo, str(n), "40", str(n + 40), "64")
    # a batch with one request too long fails as a whole and leaves nothing queued behind
    with pytest.raises(ValueError) as excinfo:
        llm.generate(["The capital of France is", prompt], SamplingParams(max_tokens=64 - n + 1))
    assert_clear(excinfo, str(n), "65", "64")
    out = llm.generate(["The capital of France is", prompt], SamplingParams(temperature=0, max_tokens=2))
    assert [len(c.prompt_token_ids) for c in out] == [5, n]
    assert [len(c.token_ids) for c in out] == [2, 2]


def test_empty_and_out_of_range_prompts(default_llm: LLM) -> None:
    with pytest.raises(ValueError) as excinfo:
        default_llm.generate("", SamplingParams(max_tokens=1))
    assert_clear(excinfo, "empty")
    vocab = default_llm.config.vocab_size
    with pytest.raises(ValueError) as excinfo:
        default_llm.generate([1, 2, vocab], SamplingParams(max_tokens=1))
    assert_clear(excinfo, str(vocab))
    with pytest.raises(ValueError) as excinfo:
        default_llm.logits([5, -1])
    assert_clear(excinfo, "-1")
