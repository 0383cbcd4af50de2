"""weft's services, one subpackage per process role.

The offline entry point is resolved lazily (``from services import LLM``):
every ``services.*`` import runs this file, and the API process must not
pay for torch.
"""
from __future__ import annotations

from typing import Any

_LAZY = {
    "LLM": ("services.llm", "LLM"),
    "RequestOutput": ("services.llm", "RequestOutput"),
    "CompletionOutput": ("services.llm", "CompletionOutput"),
    "SamplingParams": ("protocol", "SamplingParams"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'services' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    return getattr(importlib.import_module(module_name), attr)


__all__ = list(_LAZY)
