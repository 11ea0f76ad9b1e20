"""Open a GGUF file: metadata, config and tensors (kept as raw GGUF blocks), with clear errors for bad files."""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf

from gpullama.config import ModelConfig


class ModelFileError(ValueError):
    """A model file that cannot be used: missing, not GGUF, truncated, or of an unsupported kind."""


@dataclass
class GGUFModel:
    """What a GGUF file holds, read once: metadata, config and memory-mapped tensors."""

    path: str
    metadata: dict[str, Any]
    config: ModelConfig
    tensors: dict[str, Any]  # name -> gpullama.quants.QTensor


@dataclass
class TensorInfo:
    """A tensor as the GGUF header describes it: logical shape (rows first) and type."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    offset: int = 0  # of its data, from the start of the file's data section


@dataclass
class GGUFHeader:
    """The metadata and tensor list of a GGUF file, without its tensor data or its large arrays."""

    path: str
    metadata: dict[str, Any]  # arrays of more than `max_array` items are `ArraySummary`s
    tensors: list[TensorInfo]
    config: ModelConfig
    data_start: int = 0  # file offset of the (aligned) data section


@dataclass
class ArraySummary:
    """A large metadata array read only for its length (e.g. the vocabulary's 49k tokens)."""

    length: int

    def __len__(self) -> int:
        return self.length


def _check_file(path: str) -> int:
    """Raise ModelFileError unless `path` is a readable file starting with the GGUF magic; returns its size."""
    if not os.path.exists(path):
        raise ModelFileError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise ModelFileError(f"{path} is a directory, not a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return os.path.getsize(path)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_header(path: str, max_array: int | None = 4096, text_model: bool = True) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor list only (what `gpullama info` shows), fast: the tensor data is
    never touched and arrays longer than `max_array` (None: no limit) are skipped over, kept as their length.
    gguf's own reader builds a view of every array item (seconds for a 150k-token vocabulary), so this walks the
    header itself. `text_model` False: a file without a text model's config (an mmproj file; `config` is None)."""
    path = os.fspath(path)
    size = _check_file(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            metadata, tensors, data_start = _parse_header(path, buf, max_array)
        except (struct.error, UnicodeDecodeError, KeyError, ValueError) as exc:
            if isinstance(exc, ModelFileError):
                raise
            raise ModelFileError(
                f"{path}: corrupt or truncated GGUF file: its header and metadata do not parse within its {size} "
                f"bytes ({type(exc).__name__}: {exc})"
            ) from None
    if not text_model:
        return GGUFHeader(path, metadata, tensors, None, data_start)
    # outside the parse: an unsupported architecture or a missing key is not a corrupt file
    config = ModelConfig.from_metadata(metadata, path)
    _set_tensor_flags(config, {t.name: t.shape for t in tensors})
    return GGUFHeader(path, metadata, tensors, config, data_start)


def _parse_header(path: str, buf: mmap.mmap, max_array: int | None) -> tuple[dict[str, Any], list[TensorInfo], int]:
    """Metadata, tensor list and the file offset of the aligned data section."""
    pos = 4

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        text = bytes(buf[pos : pos + n]).decode("utf-8")
        pos += n
        return text

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, count = take("<I"), take("<Q")
            if max_array is None or count <= max_array:
                return [value(item) for _ in range(count)]
            if item == _STRING:
                for _ in range(count):
                    n = take("<Q")
                    pos += n
            elif item in _SCALARS:
                pos += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    value(item)
            return ArraySummary(count)
        return take(_SCALARS[kind])

    version = take("<I")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = take("<Q"), take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        metadata[key] = value(take("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        qtype = gguf.GGMLQuantizationType(take("<I"))
        tensors.append(TensorInfo(name, tuple(reversed(dims)), qtype, take("<Q")))
    alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    return metadata, tensors, -(-pos // alignment) * alignment


def _set_tensor_flags(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Flags and sizes that the tensors present decide, not the metadata."""
    first = config.kv_layers[0] if config.kv_layers else 0  # the first layer with attention
    config.attention_bias = f"blk.{first}.attn_q.bias" in shapes
    config.qk_norm = f"blk.{first}.attn_q_norm.weight" in shapes
    config.tied_embeddings = "output.weight" not in shapes
    config.attn_output_bias = f"blk.{first}.attn_output.bias" in shapes
    config.attn_sinks = f"blk.{first}.attn_sinks.weight" in shapes
    if "token_embd.weight" in shapes:
        config.vocab_size = shapes["token_embd.weight"][0]
    if config.is_moe:
        _set_expert_sizes(config, shapes)


def _set_expert_sizes(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """The expert sizes the tensors have (the first MoE layer's), checked against ``expert_count``; files with one
    tensor per expert (old Mixtral conversions) are refused."""
    arch = config.architecture
    layer = next((i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes), None)
    if layer is None:
        if "blk.0.ffn_gate.0.weight" in shapes:
            raise ValueError(
                f"{arch} model stores one tensor per expert (blk.0.ffn_gate.0.weight): an old conversion; convert it "
                f"again with a current llama.cpp (experts stacked in ffn_gate_exps)"
            )
        raise ValueError(f"'{arch}.expert_count' = {config.num_experts} but no layer has a router (ffn_gate_inp)")
    p = f"blk.{layer}."
    if p + "ffn_gate_up_exps.weight" in shapes:
        experts, rows, _ = shapes[p + "ffn_gate_up_exps.weight"]
        rows //= 2
    elif p + "ffn_gate_exps.weight" in shapes:
        experts, rows, _ = shapes[p + "ffn_gate_exps.weight"]
    else:
        raise ValueError(f"{arch} model file has no tensor {p + 'ffn_gate_exps.weight'!r}")
    if experts != config.num_experts:
        raise ValueError(
            f"tensor {p}ffn_gate_exps.weight holds {experts} experts; '{arch}.expert_count' says {config.num_experts}"
        )
    config.expert_intermediate_size = rows
    if p + "ffn_gate_shexp.weight" in shapes:
        config.shared_expert_intermediate_size = shapes[p + "ffn_gate_shexp.weight"][0]


@dataclass
class ModelSize:
    """What a model holds and what one token uses: parameters, and the weight bytes a token's step reads."""

    parameters: int
    active_parameters: int  # with each MoE layer's unused experts left out (all of them in a dense model)
    expert_parameters: int
    bytes: int  # of every tensor, as stored
    active_bytes: int  # read for one token: all but the unused experts, one embedding row (and one row of Gemma 4's
    # per-layer table), and the table in full where it is also the output head (no output.weight)


def model_size(header: GGUFHeader) -> ModelSize:
    """Parameters and bytes of a model, and those one token uses (``num_experts_used`` of ``num_experts`` experts)."""
    c = header.config
    share = c.num_experts_used / c.num_experts if c.is_moe else 1.0
    tied = not any(t.name == "output.weight" for t in header.tensors)  # the embedding table is the output head too
    params = active = experts = nbytes = active_bytes = 0
    for t in header.tensors:
        count = 1
        for d in t.shape:
            count *= d
        block, size = gguf.GGML_QUANT_SIZES[t.qtype]
        stored = count // block * size
        params, nbytes = params + count, nbytes + stored
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= c.num_layers:  # GLM-4.5's MTP layer: not run
            continue
        if "_exps." in t.name:
            experts += count
            active += round(count * share)
            active_bytes += round(stored * share)
        else:
            active += count
            if t.name == "token_embd.weight":  # one row looked up; the whole table again where it is the head
                active_bytes += stored // t.shape[0] + (stored if tied else 0)
            elif t.name == "per_layer_token_embd.weight":  # Gemma 4's per-layer table: one row looked up
                active_bytes += stored // t.shape[0]
            else:
                active_bytes += stored
    return ModelSize(params, active, experts, nbytes, active_bytes)


FILE_TYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw", 32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE",
}
"""llama.cpp's names of the `general.file_type` values (`llama_model_ftype_name`), as llama-bench prints them."""


def file_type_name(header: GGUFHeader) -> str:
    """The file's type as llama.cpp names it (``general.file_type`` 15: ``"Q4_K - Medium"``); without that key, the
    most common matrix type followed by ``(guessed)``, as llama.cpp does."""
    value = header.metadata.get("general.file_type")
    if isinstance(value, int) and not value & 1024:
        if value in FILE_TYPE_NAMES:
            return FILE_TYPE_NAMES[value]
        try:
            return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
        except ValueError:
            return f"file type {value}"
    counts: dict[str, int] = {}
    for t in header.tensors:
        if len(t.shape) == 2:
            counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    return f"{max(counts, key=counts.get)} (guessed)" if counts else "?"


def check_model_file(path: str) -> GGUFHeader:
    """Read the header of `path` and check that the file holds every tensor it lists, without touching the tensor
    data (milliseconds): `ModelFileError` for a missing, non-GGUF, corrupt or truncated file or an unsupported
    architecture; returns the header."""
    from gguf.constants import GGML_QUANT_SIZES

    header = read_header(path)
    size = os.path.getsize(header.path)
    for t in header.tensors:
        block, type_size = GGML_QUANT_SIZES.get(t.qtype, (0, 0))
        if not block:
            continue  # an unknown type: the load names it
        end = header.data_start + t.offset + math.prod(t.shape) // block * type_size
        if end > size:
            raise ModelFileError(f"{header.path}: truncated GGUF file: tensor {t.name!r} ends at byte {end} but the "
                                 f"file has {size} bytes")
    return header


def read_gguf(path: str, text_model: bool = True) -> GGUFModel:
    """Read metadata and tensors of a GGUF model file (memory-mapped, nothing dequantized).

    The header is walked by `read_header` (every array read whole: tenths of a second where gguf's reader takes
    seconds on a large vocabulary) and each tensor is a zero-copy view of its bytes in a read-only memory map."""
    import numpy as np

    from gpullama.quants import QTensor, _from_numpy, expected_nbytes  # torch: only for a model that loads

    path = os.fspath(path)
    header = read_header(path, max_array=None, text_model=text_model)
    size = os.path.getsize(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, QTensor] = {}
    for t in header.tensors:
        try:
            nbytes = expected_nbytes(t.qtype, t.shape, t.name)
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}") from None
        start = header.data_start + t.offset
        if start + nbytes > size:
            raise ModelFileError(
                f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte {start + nbytes} but the file has "
                f"{size} bytes"
            )
        try:
            tensors[t.name] = QTensor(_from_numpy(data[start : start + nbytes]), t.qtype, t.shape, t.name)
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}") from None
    return GGUFModel(path=path, metadata=header.metadata, config=header.config, tensors=tensors)
