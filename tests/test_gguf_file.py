"""`read_gguf` walks the header itself: its metadata and tensor bytes must be exactly what gguf's own reader sees."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from gpullama.gguf_file import read_gguf


@pytest.mark.parametrize("which", ["default", "tiny_qwen3_q8_0", "tiny_llama_q4_k"])
def test_metadata_and_tensor_bytes_equal_gguf_readers(which: str, default_model_path: Path, tiny_model) -> None:
    path = {"default": default_model_path, "tiny_qwen3_q8_0": tiny_model("qwen3", "Q8_0").path,
            "tiny_llama_q4_k": tiny_model("llama", "Q4_K").path}[which]
    ours = read_gguf(str(path))
    reader = gguf.GGUFReader(path, "r")
    want = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert ours.metadata == want
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type and mine.shape == tuple(int(s) for s in reversed(t.shape.tolist()))
        assert mine.data.numpy().tobytes() == np.asarray(t.data).tobytes(), t.name


def test_file_type_name_is_llama_cpps(tiny_model) -> None:
    """general.file_type as llama-bench labels a model (llama.cpp's llama_model_ftype_name); without the key, the
    most common matrix type, guessed."""
    from gpullama.gguf_file import file_type_name, read_header

    header = read_header(str(tiny_model("llama", "Q8_0").path))
    assert file_type_name(header) == "Q8_0"
    for value, name in ((gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_K - Medium"), (gguf.LlamaFileType.ALL_F32, "all F32"),
                        (gguf.LlamaFileType.MOSTLY_Q5_K_S, "Q5_K - Small"), (gguf.LlamaFileType.MOSTLY_BF16, "BF16")):
        header.metadata["general.file_type"] = int(value)
        assert file_type_name(header) == name
    del header.metadata["general.file_type"]
    assert file_type_name(header) == "Q8_0 (guessed)"
