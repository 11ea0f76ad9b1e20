"""Tensor parallelism's collectives: the one small object the decoder and the model runner are handed.

A `TensorParallel` says which rank of how many this process is and runs the few collectives a step needs: the
all-reduce after each row-parallel matmul (and after the vocabulary-parallel embedding), the gather of the logits to
rank 0, and the broadcast of each step's inputs from rank 0. With one rank each of them returns its input as it
is: no copy and no call into torch.distributed, so the single-device path is the N = 1 case of the same code.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# Ranks > 0 wait inside the step broadcast between steps, however long the server idles: that group never times out.
_IDLE_TIMEOUT = datetime.timedelta(days=365)
# The forward's collectives only wait for the slowest rank of a step (the default of torch.distributed).
_STEP_TIMEOUT = datetime.timedelta(minutes=30)


class TensorParallel:
    """One rank's place in a tensor-parallel group and the collectives of a step.

    `group` runs the forward's collectives (NCCL on CUDA, gloo on the CPU); `cpu_group` (gloo) carries host tensors:
    the step inputs rank 0 broadcasts and the start-up agreement. `failure` is set (by whoever watches the other
    ranks) once a rank is gone: the group cannot run another step.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, cpu_group=None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.cpu_group = cpu_group
        self.failure: str | None = None

    @classmethod
    def join(cls, rank: int, world_size: int, store: dist.Store, device: torch.device) -> TensorParallel:
        """Join the group whose ranks meet at `store` (NCCL for CUDA devices, gloo otherwise); every rank calls it."""
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                                timeout=_STEP_TIMEOUT,
                                device_id=torch.device("cuda", device.index or 0) if cuda else None)  # NCCL: its GPU
        cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        return cls(rank, world_size, dist.group.WORLD, cpu_group)

    def leave(self) -> None:
        """Tear down this process's side of the group (a no-op with one rank)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, float32 (in place when `x` is float32 already)."""
        if self.world_size == 1:
            return x
        if x.dtype != torch.float32:  # sum the partial products at the residual stream's precision
            x = x.float()
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `x` side by side along the last dim (rank order); other ranks: their own `x`."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else x

    def broadcast_from_first(self, buffer: torch.Tensor) -> None:
        """Rank 0's `buffer` (a host tensor) into every rank's `buffer`."""
        if self.world_size > 1:
            dist.broadcast(buffer, 0, group=self.cpu_group)

    def agree_min(self, value: int) -> int:
        """The smallest `value` any rank holds (e.g. the KV blocks every rank's memory allows)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())
