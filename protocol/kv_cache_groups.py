"""How a model's layers share the paged KV cache: groups of layers by attention type.

Full-attention layers need every earlier token's K/V; sliding-window layers
only the last ``window`` tokens'. As in vLLM's hybrid KV cache manager, the
layers are cut into groups of equal size, each group all one type, and
every group keeps its own block table: a window group's table drops (and
the pool gets back) the blocks that fell out of the window, a full group's
never does. Blocks come from one shared pool, and a block id means the
same memory in every group: layer ``j`` of each group lives in KV tensor
``j``, so one block holds ``group_size`` layers' K/V whichever group took it.

The group size is the gcd of the layer counts per type (Gemma 3: 3 global
+ 15 window layers -> six groups of 3); a model with one attention type
has a single group of all its layers, the plain paged cache.

Pure data, shared by the torch-free scheduler and the worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # layer indices, ascending; layers[j] uses KV tensor j


def kv_cache_groups(layer_windows: list[int], num_layers: int) -> list[KVCacheGroup]:
    """``layer_windows[i]``: layer i's sliding window, 0 for full attention; empty: all full.

    Full-attention groups come first, so group 0 is a full group whenever the model has one.
    """
    windows = list(layer_windows) or [0] * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"layer_sliding_windows has {len(windows)} entries for {num_layers} layers.")
    by_type: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        by_type.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_type.values()))
    groups = []
    for window in sorted(by_type):  # 0 (full) first
        layers = by_type[window]
        groups += [
            KVCacheGroup(window or None, tuple(layers[i : i + size])) for i in range(0, len(layers), size)
        ]
    return groups


def layer_placement(groups: list[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    """layer -> (group index, KV tensor index)."""
    return {layer: (g, j) for g, group in enumerate(groups) for j, layer in enumerate(group.layers)}


def group_windows(model: ModelConfig) -> list[int | None]:
    """Each KV cache group's sliding window (None: full) for the model's layers."""
    windows = model.layer_sliding_windows
    return [g.window for g in kv_cache_groups(windows, len(windows))] if windows else [None]
