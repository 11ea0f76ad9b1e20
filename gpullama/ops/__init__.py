"""The ops seam: one method per op, the same call on CPU and GPU; the backend is picked once at load.

`TorchOps` (`gpullama.ops.torch_ops`) is the plain torch implementation: the CPU path, and the oracle for the
kernels. `TritonOps` (`gpullama.ops.triton_ops`) overrides each op with a fused Triton kernel from
`gpullama.kernels`, which is leaf code that knows nothing of this package; `CpuOps` (`gpullama.ops.cpu_ops`), the
CPU fast path, overrides them with the C kernels of `gpullama.kernels.cpu_native`. `select_ops` picks one per device;
callers then ask a backend's capabilities (``supports_cuda_graphs``), never its name.

Shape contract (T tokens in a ragged batch of B sequences; Hq query heads, Hk kv heads, D head dim):
- hidden states are ``[T, H]``; q is ``[T, Hq, D]``, k and v ``[T, Hk, D]``;
- the paged KV pool of one layer is ``[num_blocks, block_size, Hk, D]`` for k and for v; multi-head latent
  attention's is one ``[num_blocks, block_size, 1, rope + kv_lora_rank]`` pool (`latent_rope_and_cache`,
  `latent_attention`), its values the latent part of each row;
- ``BatchMetadata`` says where each token sits (position, KV slot) and which sequence owns it.
"""

from __future__ import annotations

import torch

from gpullama.kernels import cpu_native
from gpullama.ops.cpu_ops import CpuOps
from gpullama.ops.metadata import BatchMetadata
from gpullama.ops.rope import YarnParams, rope_cos_sin
from gpullama.ops.sampling import keep_mask
from gpullama.ops.torch_ops import TorchOps

__all__ = ["BatchMetadata", "CpuOps", "TorchOps", "YarnParams", "keep_mask", "rope_cos_sin", "select_ops"]


def select_ops(device: torch.device, dtype: torch.dtype, quantized_cpu: bool = False,
               activation_bits: int = 16) -> TorchOps:
    """The ops backend for a device, chosen once at load: Triton kernels on CUDA; on the CPU with `quantized_cpu`,
    the C kernels on quantized weights where they build here (`cpu_native.library()`), their matmuls' activations
    rounded to `activation_bits` integers; else torch."""
    if device.type == "cpu" and quantized_cpu and cpu_native.library() is not None:
        return CpuOps(device, activation_bits)
    if device.type == "cuda":
        try:
            from gpullama.ops.triton_ops import TritonOps
        except ImportError:  # triton is not installed: the torch path still runs on CUDA
            return TorchOps(device, dtype)
        return TritonOps(device, dtype)
    return TorchOps(device, dtype)
