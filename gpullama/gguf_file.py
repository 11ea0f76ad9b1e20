"""Open a GGUF file: metadata, config and tensors (kept as raw GGUF blocks), with clear errors for bad files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import gguf

from gpullama.config import ModelConfig
from gpullama.quants import QTensor


class ModelFileError(ValueError):
    """A model file that cannot be used: missing, not GGUF, truncated, or of an unsupported kind."""


@dataclass
class GGUFModel:
    """What a GGUF file holds, read once: metadata, config and memory-mapped tensors."""

    path: str
    metadata: dict[str, Any]
    config: ModelConfig
    tensors: dict[str, QTensor]


def read_gguf(path: str) -> GGUFModel:
    """Read metadata and tensors of a GGUF model file (memory-mapped, nothing dequantized)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelFileError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise ModelFileError(f"{path} is a directory, not a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader fails with numpy errors deep inside on a cut file
        raise ModelFileError(
            f"{path}: corrupt or truncated GGUF file: its header and metadata do not parse within its {size} bytes "
            f"({type(exc).__name__}: {exc})"
        ) from None
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tensors: dict[str, QTensor] = {}
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size:
            raise ModelFileError(
                f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte {t.data_offset + int(t.n_bytes)}"
                f" but the file has {size} bytes"
            )
        try:
            tensors[t.name] = QTensor.from_reader_tensor(t)
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}") from None
    config = ModelConfig.from_metadata(metadata, path)
    config.attention_bias = "blk.0.attn_q.bias" in tensors
    config.qk_norm = "blk.0.attn_q_norm.weight" in tensors
    config.tied_embeddings = "output.weight" not in tensors
    if "token_embd.weight" in tensors:
        config.vocab_size = tensors["token_embd.weight"].shape[0]
    return GGUFModel(path=path, metadata=metadata, config=config, tensors=tensors)
