"""How much memory an engine's KV cache gets on CPU, and the context that fits it.

On a GPU the budget is a share of the device (``--gpu-memory-utilization``).
On CPU it is a share of the memory *available* on the node when its engines
start: ``MemAvailable`` of ``/proc/meminfo``, or, in a container, its cgroup's
limit minus its usage when that is lower. The launcher (``weft serve``, the
offline ``LLM``, ``engine-core --headless``) measures it once, before any
engine loads, so every engine of the node sizes its cache from the same
number: ``--cpu-memory-utilization`` of it, split evenly among the node's
engine processes, less what each one holds besides the cache (its runtime, its
weights, its profiled activation peak). ``--kv-cache-memory`` gives the
cache's bytes outright instead.

No cache larger than ``max_num_seqs`` sequences of ``max_model_len`` tokens
can use is allocated. When the user left ``max_model_len`` to the model and
one sequence of the model's context does not fit, the context is lowered to
what does (``fit_max_model_len``).

Torch-free: the API process and the scheduler use it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import msgspec

from protocol.config import EngineConfig
from protocol.kv_cache_groups import group_windows

DEFAULT_CPU_MEMORY_UTILIZATION = 0.9
# A context the engine lowers max_model_len to on its own is at least this long (or the
# model's own, if shorter); below it, the start fails and says what to change.
MIN_FITTED_MAX_MODEL_LEN = 2048
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is no limit.
_NO_CGROUP_LIMIT = 1 << 60

GIB = 1 << 30


# ---------------------------------------------------------------- available memory


def mem_available(meminfo: str) -> int:
    """Bytes of ``MemAvailable`` in the text of ``/proc/meminfo``."""
    for line in meminfo.splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            if unit not in ("kB", ""):
                raise ValueError(f"/proc/meminfo: MemAvailable in unknown unit {unit!r}.")
            return int(number) * (1024 if unit == "kB" else 1)
    raise ValueError("/proc/meminfo has no MemAvailable line (Linux 3.14 and later have one).")


def cgroup_headroom(limit: str, usage: str) -> int | None:
    """A cgroup's memory limit minus its usage (the texts of ``memory.max`` and ``memory.current``,
    or v1's ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``); None without a limit."""
    limit = limit.strip()
    if limit == "max" or int(limit) >= _NO_CGROUP_LIMIT:
        return None
    return max(0, int(limit) - int(usage.strip()))


def _cgroup_dirs(root: Path) -> list[tuple[Path, str, str]]:
    """(folder, limit file, usage file) of every cgroup level above this process, innermost first:
    a limit set on any ancestor bounds it too."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            base, files = root / "sys/fs/cgroup", ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = root / "sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        found += [(base.joinpath(*parts[:depth]), *files) for depth in range(len(parts), -1, -1)]
    return found


def cgroup_memory_headroom(root: Path = Path("/")) -> int | None:
    """The least headroom (limit minus usage) of this process's memory cgroups; None without a limit."""
    headrooms = []
    for folder, limit_file, usage_file in _cgroup_dirs(root):
        try:
            headroom = cgroup_headroom((folder / limit_file).read_text(), (folder / usage_file).read_text())
        except (OSError, ValueError):
            continue  # no such level here (a container sees only its own part of the tree)
        if headroom is not None:
            headrooms.append(headroom)
    return min(headrooms, default=None)


def node_available_memory(root: Path = Path("/")) -> int:
    """Bytes this node can give new processes now: ``MemAvailable``, bounded by the cgroup's headroom."""
    available = mem_available((root / "proc/meminfo").read_text())
    headroom = cgroup_memory_headroom(root)
    return available if headroom is None else min(available, headroom)


def node_available_memory_or_none(root: Path = Path("/")) -> int | None:
    """``node_available_memory``, or None where ``/proc/meminfo`` cannot be read (not Linux)."""
    try:
        return node_available_memory(root)
    except OSError:
        return None


def with_node_memory(config: EngineConfig, engines_on_node: int, available: int | None) -> EngineConfig:
    """``config`` for the engines of one node: how many share it, and the memory their launcher
    measured available there (None: each worker measures it), in place of the config's."""
    if engines_on_node < 1:
        raise ValueError(f"engines_on_node must be at least 1, got {engines_on_node}.")
    cache = config.cache
    if cache.kv_cache_memory is not None or cache.num_gpu_blocks_override is not None:
        available = None  # the budget is given: nothing to measure
    cache = msgspec.structs.replace(cache, engines_on_node=engines_on_node, available_memory=available)
    return msgspec.structs.replace(config, cache=cache)


# ---------------------------------------------------------------- the KV budget


def engine_share(available: int, utilization: float, num_processes: int) -> int:
    """One engine process's bytes: ``utilization`` of ``available``, split evenly among the processes
    that load a model on this node (data-parallel ranks x tensor-parallel workers)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"cpu_memory_utilization must be in (0, 1], got {utilization}.")
    return int(available * utilization) // max(1, num_processes)


def blocks_per_sequence(
    num_tokens: int, block_size: int, group_windows: list[int | None], step_tokens: int
) -> int:
    """KV blocks one sequence of ``num_tokens`` tokens holds at most, over every KV cache group:
    a full-attention group all of its blocks, a sliding-window group those its window and one
    step's tokens span (``services/engine_core/kv_cache_manager.py`` frees the rest)."""
    full = -(-num_tokens // block_size)
    window_blocks = [min(full, -(-(w - 1 + step_tokens) // block_size) + 1) for w in group_windows if w]
    return full * sum(1 for w in group_windows if not w) + sum(window_blocks)


def fitting_len(num_blocks: int, block_size: int, group_windows: list[int | None], step_tokens: int) -> int:
    """The longest sequence, in whole blocks of tokens, that ``num_blocks`` (the null block
    included) hold: 0 when not even one block's worth does."""
    usable = num_blocks - 1
    low, high = 0, max(0, usable)  # in blocks of tokens; blocks_per_sequence grows with the length
    while low < high:
        mid = (low + high + 1) // 2
        if blocks_per_sequence(mid * block_size, block_size, group_windows, step_tokens) <= usable:
            low = mid
        else:
            high = mid - 1
    return low * block_size


def fit_config_max_model_len(config: EngineConfig, num_blocks: int, block_bytes: int | None = None) -> int:
    """``fit_max_model_len`` for ``config``'s model, cache and step budget."""
    model = config.model
    return fit_max_model_len(
        model.max_model_len,
        auto=model.max_model_len_auto,
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        group_windows=group_windows(model),
        step_tokens=config.scheduler.max_num_batched_tokens,
        block_bytes=block_bytes,
    )


def fit_max_model_len(
    max_model_len: int,
    *,
    auto: bool,
    num_blocks: int,
    block_size: int,
    group_windows: list[int | None],
    step_tokens: int,
    block_bytes: int | None = None,
) -> int:
    """The context the engine serves with ``num_blocks`` KV blocks (the null block included).

    ``max_model_len`` itself when one such sequence fits. Else, when it was the model's own
    (``auto``), the longest multiple of ``block_size`` that fits, provided that is at least
    ``MIN_FITTED_MAX_MODEL_LEN``; otherwise a ValueError that names the numbers."""
    needed = blocks_per_sequence(max_model_len, block_size, group_windows, step_tokens) + 1
    if num_blocks >= needed:
        return max_model_len
    fits = fitting_len(num_blocks, block_size, group_windows, step_tokens)
    if auto and fits >= min(MIN_FITTED_MAX_MODEL_LEN, max_model_len):
        return fits
    size = "" if block_bytes is None else f" ({gib_text(needed * block_bytes)})"
    held = "" if block_bytes is None else f" ({gib_text(num_blocks * block_bytes)})"
    what = "the model's context" if auto else "--max-model-len"
    floor = f" (it is lowered on its own to no fewer than {MIN_FITTED_MAX_MODEL_LEN})" if auto else ""
    raise ValueError(
        f"The KV cache is too small: one sequence of {what} ({max_model_len} tokens) needs {needed} "
        f"blocks of {block_size} tokens{size}, the null block included, but {num_blocks} fit{held}, "
        f"which hold {fits} tokens{floor}. Lower --max-model-len, give the cache more memory "
        "(--kv-cache-memory BYTES, or a larger --cpu-memory-utilization / --gpu-memory-utilization), "
        "or free memory on this machine."
    )


def useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int, group_windows, step_tokens) -> int:
    """The most blocks the scheduler could ever hold at once (the null block included): more is never used."""
    return max_num_seqs * blocks_per_sequence(max_model_len, block_size, group_windows, step_tokens) + 1


@dataclass(frozen=True)
class MemoryPlan:
    """What one worker's memory holds, for the start-up log line."""

    source: str  # how the KV bytes were chosen, in words
    runtime: int  # the process before its model (interpreter, torch, libraries)
    weights_packed: int  # GGUF blocks kept quantized
    weights_dense: int  # parameters in the model dtype (dense layers, embeddings, norms, copies)
    weights_other: int  # repacked layouts and int8 copies held outside the parameters
    activation_peak: int
    num_blocks: int  # the null block included
    block_size: int
    block_bytes: int
    kv_dtype: str
    max_model_len: int
    native_max_model_len: int

    def describe(self) -> str:
        weights = self.weights_packed + self.weights_dense + self.weights_other
        kv = self.num_blocks * self.block_bytes
        tokens = max(0, self.num_blocks - 1) * self.block_size
        context = (
            f"max_model_len {self.max_model_len}"
            if self.max_model_len == self.native_max_model_len
            else f"max_model_len {self.max_model_len} (the model's {self.native_max_model_len} does not fit)"
        )
        return (
            f"Memory plan: {self.source}; runtime {gib_text(self.runtime)}, weights {gib_text(weights)} "
            f"(packed {gib_text(self.weights_packed)}, dense {gib_text(self.weights_dense)}, other "
            f"{gib_text(self.weights_other)}), activation peak {gib_text(self.activation_peak)}; KV cache "
            f"{gib_text(kv)} in {self.num_blocks} blocks of {self.block_size} tokens ({tokens:,} tokens, "
            f"{self.kv_dtype}); {context}."
        )


def gib_text(nbytes: int) -> str:
    """Bytes for a log line: GiB with two decimals, KiB below a hundredth of one."""
    if abs(nbytes) >= GIB // 100:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{math.ceil(nbytes / 1024):,} KiB" if abs(nbytes) >= 1024 else f"{nbytes} B"
