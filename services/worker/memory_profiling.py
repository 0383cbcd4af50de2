"""Memory measurements for sizing the KV cache.

On CUDA, torch's allocator statistics. On CPU there is no allocator to
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
from pathlib import Path

import torch


def gpu_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes the worker may use on its GPU for weights, activations and the KV cache together
    (the CPU's budget: ``services.config.memory_plan``)."""
    _, total = torch.cuda.mem_get_info(device)
    return int(total * gpu_memory_utilization)


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
