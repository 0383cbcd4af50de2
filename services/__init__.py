"""weft's services, one subpackage per process role.

The offline entry point is resolved lazily (``from services import LLM``):
every ``services.*`` import runs this file, and the API process must not
pay for torch.
"""

from __future__ import annotations

import os
from typing import Any

# Engine processes share few cores (several per machine, next to the API).
# With OpenMP's default spin-then-sleep policy, every multi-threaded torch op
# stalls ~8 ms whenever another process holds a core; passive waiting cuts
# that to tens of microseconds (measured: a 64-sequence decode step went from
# ~9.7 s to ~0.64 s under load). libgomp reads this when torch is imported,
# so it is set here, before any services.* module can import torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_LAZY = {
    "LLM": ("services.llm", "LLM"),
    "RequestOutput": ("services.llm", "RequestOutput"),
    "CompletionOutput": ("services.llm", "CompletionOutput"),
    "SamplingParams": ("protocol", "SamplingParams"),
    "StructuredOutputsParams": ("protocol", "StructuredOutputsParams"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'services' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    return getattr(importlib.import_module(module_name), attr)


__all__ = list(_LAZY)
