"""The tensor-parallel process group of one engine core's workers.

Each worker process calls ``init_tensor_parallel`` once, before it builds
its model; the sharded layers then talk to their peers through the
``TensorParallelGroup`` they were built with. Collectives are
torch.distributed's own (gloo on CPU, NCCL on CUDA); nothing here is a
hand-written reduction.

With one rank nothing is initialised: every collective is the identity, so
the same layers serve TP=1 with no torch.distributed at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a collective may wait for a peer before failing. A peer that dies
# breaks its connections and fails the collective long before this; the
# timeout only bounds a peer that hangs while alive.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
DRIVER_RANK = 0


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place among the engine core's ``world_size`` workers."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}.")

    @property
    def is_driver(self) -> bool:
        """The driver rank samples and returns the step's output."""
        return self.rank == DRIVER_RANK

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the sum."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along ``dim`` on the driver; None elsewhere."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=DRIVER_RANK)
        return torch.cat(parts, dim=dim) if self.is_driver else None

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, on every rank."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite ``x`` on every rank with the driver's ``x`` (in place)."""
        if self.world_size > 1:
            dist.broadcast(x, src=DRIVER_RANK)
        return x


_group = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    """This process's group: one rank unless ``init_tensor_parallel`` said otherwise."""
    return _group


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str | None, device: torch.device
) -> TensorParallelGroup:
    """Join the engine core's process group (blocks until every rank joined).

    Called once per worker process; with one rank it only records the group.
    """
    global _group
    group = TensorParallelGroup(rank, world_size)
    if world_size > 1:
        if init_method is None:
            raise ValueError("Tensor parallelism needs an init_method to meet the other ranks.")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
        )
    _group = group
    return group


def destroy_tensor_parallel() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, or a ValueError naming ``what`` does not split evenly."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}); "
            f"choose a tensor_parallel_size that divides it."
        )
    return numerator // denominator
