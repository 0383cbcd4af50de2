"""Gemma 3's layer layout read from its config, torch-free (the engine arguments and the scheduler need it, and the model)."""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_SLIDING_WINDOW = 4096  # transformers' Gemma3TextConfig default


def gemma3_layer_types(config: dict, layers: int) -> tuple[str, ...]:
    types = config.get("layer_types")
    if types is None:  # older configs: every ``pattern``-th layer is global
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {layers} entries of {SLIDING!r} or {FULL!r}, got {types}.")
    return tuple(types)


def gemma3_sliding_window(config: dict) -> int:
    return config.get("sliding_window") or DEFAULT_SLIDING_WINDOW
