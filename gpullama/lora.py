"""LoRA adapters in llama.cpp's GGUF format, as its ``convert_lora_to_gguf.py`` writes them and its
``src/llama-adapter.cpp`` reads them: ``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``,
and for each adapted matrix ``<name>.lora_a`` ``[r, K]`` and ``<name>.lora_b`` ``[N, r]`` (torch order); the
product added to the matrix's output is ``scale * alpha / r * B (A x)`` (llama.cpp's ``get_scale``: ``alpha`` 0
means no ``alpha / r`` factor), `scale` being the request's (or the server's) scale of the adapter. For
``token_embd.weight`` llama.cpp's converter stores A transposed (``[vocab, r]``): a token's row of A times B is
added to its embedding. ``*_norm.weight`` tensors (mergekit's) are skipped, as llama.cpp does.

`read_lora` reads a file, `prepare_lora` checks it against a loaded `gpullama.model.Decoder` (the architecture and
every shape; clear errors otherwise) and turns it into `Adapter`: float32 pairs on the model's device, each placed
at its columns of the decoder's fused matrices (q|k|v, gate|up), B's rows un-permuted where the decoder un-permutes
the base's Q/K rows and B already times ``alpha / r``. The decoder applies them per row (`LoraGroup` in
`gpullama.ops.metadata`); the CPU stack reads `Adapter.native`.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from gpullama.gguf_file import ModelFileError, _check_file, _parse_header
from gpullama.kernels import cpu_native
from gpullama.model import unpermute_qk_rows

log = logging.getLogger("gpullama")

# the base matrices an adapter may change: the site of the decoder's matrix that holds its output
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_qkv|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
SITES = ("qkv", "o", "gate_up", "down")
"""The decoder layer's matrices an adapter adds to, in the order of `gpullama.kernels.cpu_native.LoraLayer`."""
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd",
           "output")
"""The base tensors (``.weight``) an adapter may target."""


@dataclass
class LoraFile:
    """A GGUF LoRA adapter as read: its base architecture, alpha and (A, B) pairs by base tensor name."""

    path: str
    architecture: str
    alpha: float
    pairs: dict[str, tuple[Any, Any]]  # base tensor name -> (lora_a, lora_b) QTensors
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoraPair:
    """One adapted matrix of a layer: ``B (A x)`` is added to output columns ``offset .. offset + B.shape[0]``."""

    offset: int
    a: torch.Tensor  # [r, K] float32
    b: torch.Tensor  # [N, r] float32, times alpha / r


@dataclass
class Adapter:
    """An adapter prepared for one decoder (see the module's docstring)."""

    name: str
    path: str
    alpha: float
    layers: list[dict[str, list[LoraPair]]]
    embedding: tuple[torch.Tensor, torch.Tensor] | None = None  # A [vocab, r], B [H, r] (times alpha / r)
    output: LoraPair | None = None
    _native: Any = None

    @property
    def targets(self) -> int:
        """How many matrices it changes."""
        return sum(len(p) for layer in self.layers for p in layer.values()) + (self.embedding is not None) + (
            self.output is not None)

    def native(self) -> ctypes.Array:
        """Its layers as `cpu_native.LoraLayer` structs for the CPU stack (built once; they point into `layers`'
        A matrices and into B's transposed copies, kept with them)."""
        if self._native is None:
            arr = (cpu_native.LoraLayer * len(self.layers))()
            keep = []
            for dst, layer in zip(arr, self.layers):
                for s, site in enumerate(SITES):
                    pairs = layer.get(site, [])
                    dst.n[s] = len(pairs)
                    for j, p in enumerate(pairs):
                        bt = p.b.t().contiguous()
                        keep.append(bt)
                        dst.p[s][j] = cpu_native.Lora(p.offset, p.b.shape[0], p.a.shape[1], p.a.shape[0],
                                                      p.a.data_ptr(), bt.data_ptr())
            self._native = (arr, keep)
        return self._native[0]


def read_lora(path: str | os.PathLike) -> LoraFile:
    """Read a GGUF LoRA adapter (llama.cpp's format); `ModelFileError` naming what is wrong with the file."""
    import numpy as np

    from gpullama.quants import QTensor, _from_numpy, expected_nbytes

    path = os.fspath(path)
    size = _check_file(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            metadata, infos, data_start = _parse_header(path, buf, 4096)
        except (struct.error, UnicodeDecodeError, KeyError, ValueError) as exc:
            if isinstance(exc, ModelFileError):
                raise
            raise ModelFileError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from None
    kind = metadata.get("general.type")
    if kind != "adapter":
        raise ModelFileError(f"{path}: not a LoRA adapter: general.type is {kind!r}, expected 'adapter' (a GGUF "
                             f"adapter as llama.cpp's convert_lora_to_gguf.py writes it)")
    if metadata.get("adapter.type") != "lora":
        raise ModelFileError(f"{path}: adapter.type is {metadata.get('adapter.type')!r}, expected 'lora'")
    if metadata.get("adapter.alora.invocation_tokens") is not None:
        raise ModelFileError(f"{path}: activated LoRA (adapter.alora.invocation_tokens) is not supported")
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: the adapter has no general.architecture")
    alpha = float(metadata.get("adapter.lora.alpha", 0.0) or 0.0)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    halves: dict[str, dict[str, Any]] = {}
    for t in infos:
        if t.name.endswith("_norm.weight"):
            log.info("%s: skipping %s (norm vectors of an adapter are not applied, as in llama.cpp)", path, t.name)
            continue
        base, dot, half = t.name.rpartition(".")
        if not dot or half not in ("lora_a", "lora_b"):
            raise ModelFileError(f"{path}: LoRA tensor {t.name!r} has an unexpected suffix (expected .lora_a or "
                                 f".lora_b)")
        try:
            nbytes = expected_nbytes(t.qtype, t.shape, t.name)
            start = data_start + t.offset
            if start + nbytes > size:
                raise ValueError(f"truncated file: tensor {t.name!r} ends at byte {start + nbytes} of {size}")
            halves.setdefault(base, {})[half] = QTensor(_from_numpy(data[start : start + nbytes]), t.qtype, t.shape,
                                                        t.name)
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}") from None
    pairs = {}
    for base, h in halves.items():
        if len(h) != 2:
            raise ModelFileError(f"{path}: LoRA tensor pair for {base!r} is missing one component")
        pairs[base] = (h["lora_a"], h["lora_b"])
    if not pairs:
        raise ModelFileError(f"{path}: the adapter has no lora_a/lora_b tensors")
    return LoraFile(path, arch, alpha, pairs, metadata)


def prepare_lora(decoder: Any, lora: LoraFile, name: str) -> Adapter:
    """`lora` checked against `decoder` (a `gpullama.model.Decoder`) and placed in its matrices; ValueError naming
    the tensor, its shape and the base's where they do not match (the hint: a wrong base model)."""
    c, where = decoder.config, lora.path
    if lora.architecture != c.architecture:
        raise ValueError(f"LoRA adapter {where}: made for architecture {lora.architecture!r}, but the model is "
                         f"{c.architecture!r}")
    if decoder.tp.world_size > 1:
        raise ValueError("LoRA adapters are not supported with tensor parallelism")
    if c.head_dim_swa or c.kv_shared_layers or c.per_layer_input_size:
        raise ValueError(f"LoRA adapter {where}: adapters on {c.architecture} (Gemma 4's layers of two head sizes, "
                         f"shared K/V and per-layer inputs) are not supported")
    shapes, device = decoder.tensor_shapes, decoder.ops.device
    q_size, kv_size = decoder.num_heads * c.head_dim, decoder.num_kv_heads * c.head_dim
    layers: list[dict[str, list[LoraPair]]] = [{} for _ in decoder.layers]
    embedding = output = None
    for base, (qa, qb) in sorted(lora.pairs.items()):
        if base not in shapes:
            raise ValueError(f"LoRA adapter {where}: tensor {base!r} does not exist in the base model (hint: maybe "
                             f"a wrong base model?)")
        a = qa.dequantize(torch.float32)
        b = qb.dequantize(torch.float32)
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"LoRA adapter {where}: {base}.lora_a/.lora_b are not matrices")
        rank = b.shape[1]
        n, k = shapes[base][0], shapes[base][1] if len(shapes[base]) > 1 else 1
        if base == "token_embd.weight":  # A stored transposed: [vocab, r]; B [H, r]
            if a.shape[0] != n or b.shape[0] != k or a.shape[1] != rank:
                raise ValueError(f"LoRA adapter {where}: tensor {base!r} has lora_a {tuple(a.shape)}, lora_b "
                                 f"{tuple(b.shape)}; the base is {tuple(shapes[base])} (hint: maybe a wrong base "
                                 f"model?)")
        elif a.shape[1] != k or b.shape[0] != n:
            raise ValueError(f"LoRA adapter {where}: tensor {base!r} has lora_a {tuple(a.shape)}, lora_b "
                             f"{tuple(b.shape)}; the base is {tuple(shapes[base])} (hint: maybe a wrong base model?)")
        elif a.shape[0] != rank:
            raise ValueError(f"LoRA adapter {where}: {base}.lora_a has {a.shape[0]} rows but lora_b has {rank} "
                             f"columns (lora_a is not transposed)")
        if rank > cpu_native.MAX_LORA_RANK:
            raise ValueError(f"LoRA adapter {where}: rank {rank} of {base!r} is above the limit of "
                             f"{cpu_native.MAX_LORA_RANK}")
        factor = lora.alpha / rank if lora.alpha else 1.0
        if base == "token_embd.weight":
            embedding = (a.to(device).contiguous(), (b * factor).to(device).contiguous())
            continue
        if base == "output.weight":
            output = LoraPair(0, a.to(device).contiguous(), (b * factor).to(device).contiguous())
            continue
        m = _LAYER_TENSOR.fullmatch(base)
        if m is None:
            raise ValueError(f"LoRA adapter {where}: tensor {base!r} is not one gpullama applies adapters to (the "
                             f"dense {', '.join(TARGETS)} matrices)")
        i, target = int(m.group(1)), m.group(2)
        layer = decoder.layers[i]
        if layer.moe is not None and target.startswith("ffn_"):
            raise ValueError(f"LoRA adapter {where}: {base!r} is in a mixture-of-experts layer; adapters on MoE "
                             f"layers are not supported")
        if (layer.mla is not None or layer.conv is not None or layer.delta is not None) and target.startswith("attn"):
            raise ValueError(f"LoRA adapter {where}: {base!r} belongs to a layer without plain attention "
                             f"(latent attention or a recurrent layer); adapters there are not supported")
        if target == "attn_q" and c.attn_output_gate:
            raise ValueError(f"LoRA adapter {where}: {base!r}: adapters on the gated query matrix of "
                             f"{c.architecture} are not supported")
        if target in ("attn_q", "attn_k") and c.permuted_qk:  # the decoder un-permutes these rows of the base
            b = b[unpermute_qk_rows(b.shape[0], decoder.num_heads if target == "attn_q" else decoder.num_kv_heads)]
        site, offset = {
            "attn_q": ("qkv", 0), "attn_k": ("qkv", q_size), "attn_v": ("qkv", q_size + kv_size),
            "attn_qkv": ("qkv", 0), "attn_output": ("o", 0), "ffn_gate": ("gate_up", 0),
            "ffn_up": ("gate_up", shapes.get(f"blk.{i}.ffn_gate.weight", (0,))[0]), "ffn_down": ("down", 0),
        }[target]
        layers[i].setdefault(site, []).append(
            LoraPair(offset, a.to(device).contiguous(), (b * factor).to(device).contiguous()))
    adapter = Adapter(name, lora.path, lora.alpha, layers, embedding, output)
    log.info("LoRA adapter %r (%s): %d matrices, alpha %g", name, lora.path, adapter.targets, lora.alpha)
    return adapter


def load_adapter(decoder: Any, path: str | os.PathLike, name: str | None = None) -> Adapter:
    """`read_lora` then `prepare_lora`; the name defaults to the file's stem."""
    path = os.fspath(path)
    return prepare_lora(decoder, read_lora(path), name or os.path.splitext(os.path.basename(path))[0])
