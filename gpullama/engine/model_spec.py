"""What a rank's model is built from (`ModelSpec`, read once from `EngineArgs`) and the one function that builds
it (`build_model`): `LLM` on rank 0, every tensor-parallel worker and every rank of a headless node call it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpullama.distributed import TensorParallel
from gpullama.engine.args import EngineArgs, EngineConfig
from gpullama.engine.model_runner import checkpoint_count, kv_block_bytes, kv_pool_dtype, kv_pool_size
from gpullama.gguf_file import GGUFModel, model_size, read_gguf, read_header
from gpullama.model import Decoder
from gpullama.ops import select_ops
from gpullama.quants import FLOAT_TYPES, QTensor
from gpullama.sharding import ShardPlan

log = logging.getLogger("gpullama")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when present, else the CPU; otherwise ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = str(device)
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 on the CPU (with quantized weights there for a quantized file, see
    `quantized_cpu_path`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def quantized_cpu_path(dtype: str | torch.dtype, device: torch.device, tensors: dict[str, QTensor]) -> bool:
    """Whether the model runs the CPU fast path (the weights stay quantized, C kernels; docs/usage.md, "CPU modes"):
    with ``dtype="auto"`` on the CPU for a file whose matrices are quantized. ``"float32"`` is the exact path (every
    matrix dequantized once to float32), what the parity tests use."""
    if device.type != "cpu" or dtype != "auto":
        return False
    return any(t.qtype not in FLOAT_TYPES for t in tensors.values() if len(t.shape) >= 2)


def threads_per_rank(world_size: int) -> int:
    """The CPU cores this process may use, shared out among the ranks (at least one each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


@dataclass
class ModelSpec:
    """What every rank builds its model from (sent to the tensor-parallel workers at spawn, so: picklable)."""

    path: str
    device: str  # rank 0's device; rank r runs on the r-th device after it on CUDA, on the CPU on the CPU
    dtype: torch.dtype
    max_model_len: int
    engine_config: EngineConfig
    threads: int | None  # torch intra-op threads of each rank (None: torch's choice)
    quantized_cpu: bool = False  # the CPU fast path (`select_ops`' quantized_cpu)
    activation_bits: int = 16  # the fast path's matmul activations (`EngineArgs.cpu_activation_bits`)

    @classmethod
    def from_args(cls, args: EngineArgs, gguf_model: GGUFModel, world_size: int = 1,
                  local_ranks: int = 1) -> ModelSpec:
        """The spec of `args` for the model in `gguf_model`, split over `world_size` ranks of which `local_ranks`
        share this machine (ranks on the CPU share its cores: each gets its share unless `args.threads` says).
        ValueError when the device or dtype is wrong, or the model cannot be cut into `world_size` ranks."""
        device = resolve_device(args.device)
        config = gguf_model.config
        if world_size > 1:
            ShardPlan(config, 0, world_size).check(gguf_model.tensors)
        max_model_len = args.max_model_len or config.context_length
        if max_model_len > config.context_length:
            log.warning(
                "max_model_len %d is beyond the model's trained context length %d: output past it may degrade",
                max_model_len, config.context_length,
            )
        threads = args.threads or (threads_per_rank(local_ranks) if world_size > 1 and device.type == "cpu"
                                   else None)
        return cls(gguf_model.path, str(device), resolve_dtype(args.dtype, device), max_model_len,
                   EngineConfig.from_args(args, max_model_len), threads,
                   quantized_cpu_path(args.dtype, device, gguf_model.tensors), args.cpu_activation_bits)


def estimate_memory_bytes(args: EngineArgs, path: str) -> int:
    """Bytes the model in the file `path` will hold once loaded as `args` say, from the file's header alone (no
    weight is read): the weights as its ops keep them (quantized as stored on the CPU fast path, else every tensor
    in the compute dtype), the KV pool as the engine will reserve it (its scratch block included) and a hybrid
    model's recurrent-state checkpoints (`model_runner.checkpoint_count`). Rope tables,
    step buffers and a vision tower are left out; `LLM.memory_bytes` measures a loaded model."""
    header = read_header(path)
    config = header.config
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    quantized = device.type == "cpu" and args.dtype == "auto" and any(
        t.qtype not in FLOAT_TYPES for t in header.tensors if len(t.shape) >= 2)
    size = model_size(header)
    weights = size.bytes if quantized else size.parameters * dtype.itemsize
    engine = EngineConfig.from_args(args, args.max_model_len or config.context_length)
    ops = select_ops(device, dtype, quantized)
    kv_dtype = kv_pool_dtype(ops, engine.kv_cache_dtype, config, engine.block_size)
    if engine.num_blocks:
        blocks, checkpoints = engine.num_blocks, checkpoint_count(config, engine, engine.kv_cache_memory)
    else:
        blocks, _, checkpoints = kv_pool_size(config, engine, kv_dtype, device)
    return weights + (blocks + 1) * kv_block_bytes(config, engine.block_size, kv_dtype) + \
        checkpoints * config.state_bytes


def build_model(spec: ModelSpec, tp: TensorParallel | None = None, device: torch.device | None = None,
                gguf_model: GGUFModel | None = None,
                on_progress: Callable[[str], None] | None = None) -> Decoder:
    """This rank's model (its shard under `tp`) on `device` (default the spec's): the spec's thread count set,
    the ops backend picked once, the weights taken from `gguf_model` or read from this machine's copy of the
    file. `on_progress` hears the step, for a front end to show."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = device or torch.device(spec.device)
    gguf_model = gguf_model or read_gguf(spec.path)
    ops = select_ops(device, spec.dtype, spec.quantized_cpu, spec.activation_bits)
    if on_progress is not None:
        on_progress(f"preparing {gguf_model.config.num_layers} layers of weights ({ops.mode})")
    return Decoder(gguf_model.config, gguf_model.tensors, ops, spec.max_model_len, tp)
