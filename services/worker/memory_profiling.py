"""Memory measurements for sizing the KV cache.

On CUDA, as vLLM: the driver's free and total memory (``mem_get_info``) before the model loads
and after the profile, for what torch does not allocate, and torch's allocator statistics for the
step's peak. On CPU there is no allocator to
ask, so the process's resident set is used: Linux lets a process reset its
peak RSS (write "5" to /proc/self/clear_refs), after which VmHWM is the
peak of exactly the code measured. Where that reset is refused, the rise of
the lifetime peak (getrusage) stands in; it understates the increase when an
earlier phase (weight loading) peaked higher.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class GpuSnapshot:
    """The device's memory as the driver and torch's allocator see it at one moment."""

    free: int
    total: int
    torch_reserved: int  # held by torch's caching allocator (tensors, their cache, graph pools)

    @property
    def non_torch(self) -> int:
        """Used on the device outside torch's allocator: CUDA context, cuBLAS and NCCL workspaces,
        other processes."""
        return self.total - self.free - self.torch_reserved


def gpu_snapshot(device: torch.device) -> GpuSnapshot:
    free, total = torch.cuda.mem_get_info(device)
    return GpuSnapshot(free, total, torch.cuda.memory_reserved(device))


def check_free_memory(start: GpuSnapshot, utilization: float, device: torch.device | str) -> int:
    """The bytes this worker may use (``total x utilization``), or a ValueError with the numbers when
    the device's free memory at start is short of them (another process, or a second engine, holds
    the rest): vLLM's check, before anything is loaded."""
    requested = int(start.total * utilization)
    if start.free < requested:
        raise ValueError(
            f"{device} has {_gib(start.free)} free of {_gib(start.total)} at start-up, less than "
            f"--gpu-memory-utilization {utilization} x {_gib(start.total)} = {_gib(requested)} that this "
            f"worker was asked to use ({_gib(start.total - start.free)} is held by other processes or "
            f"contexts). Lower --gpu-memory-utilization to {start.free / start.total:.2f} or below, or free "
            "the device."
        )
    return requested


@dataclass(frozen=True)
class GpuKVBudget:
    """vLLM's arithmetic: what is left for the KV cache of ``total x utilization``."""

    requested: int
    weights: int  # the loaded model on the device: parameters and buffers (rotary tables)
    activation_peak: int  # the profiled step's peak above the loaded model (torch allocations)
    non_torch: int  # the rise of memory outside torch's allocator since start (cuBLAS, NCCL)
    graph_pool: int  # the CUDA graphs' pool, captured after the cache: its profiled estimate

    @property
    def kv(self) -> int:
        return self.requested - self.weights - self.activation_peak - self.non_torch - self.graph_pool

    def describe(self, utilization: float) -> str:
        return (
            f"gpu_memory_utilization {utilization} of the GPU = {_gib(self.requested)}, less "
            f"{_gib(self.non_torch)} outside torch (cuBLAS, NCCL) and {_gib(self.graph_pool)} for the "
            "CUDA graphs"
        )


def gpu_kv_budget(
    start: GpuSnapshot,
    now: GpuSnapshot,
    *,
    utilization: float,
    weights: int,
    activation_peak: int,
    graph_pool: int,
) -> GpuKVBudget:
    """The KV budget after loading and profiling: ``start`` was taken before the model loaded,
    ``now`` after the profiled steps."""
    return GpuKVBudget(
        requested=int(start.total * utilization),
        weights=weights,
        activation_peak=activation_peak,
        non_torch=max(0, now.non_torch - start.non_torch),
        graph_pool=graph_pool,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def peak_increase(fn: Callable[[], None], device: torch.device) -> int:
    """Run ``fn`` and return how far memory rose above its starting level, in bytes."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    reset = _reset_cpu_peak()
    before = rss_bytes() if reset else _lifetime_peak_bytes()
    fn()
    after = _proc_status_bytes("VmHWM") if reset else _lifetime_peak_bytes()
    return max(0, after - before)


def _reset_cpu_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _proc_status_bytes("VmHWM") > 0
    except OSError:
        return False


def rss_bytes() -> int:
    """This process's resident bytes now (0 where /proc cannot tell: not Linux)."""
    try:
        return _proc_status_bytes("VmRSS")
    except OSError:
        return 0


def _proc_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    return 0


def _lifetime_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux
