"""weft's services, one subpackage per process role.

The offline entry point is resolved lazily (``from services import LLM``):
every ``services.*`` import runs this file, and the API process must not
pay for torch.
"""

from __future__ import annotations

from typing import Any

from services import env

# Engine processes share few cores (several per machine, next to the API).
# OpenMP's default wait policy spins a thread for about 300,000 iterations
# after each parallel region before it sleeps: every multi-threaded torch op
# then stalled ~8 ms whenever another process held a core (a 64-sequence
# decode step took ~9.7 s under load, ~0.64 s without the spin). Passive
# waiting alone (no spin) puts the other threads to sleep after every op
# instead, and waking them costs ~60 us each time: ~300 parallel ops a decode
# step, a quarter of a 64-sequence step (76 -> 50 ms with the short spin). So
# threads wait passively after a short spin, GOMP_SPINCOUNT iterations (about
# 0.1 ms here): long enough to bridge the gaps between a step's ops, short
# enough that an idle engine frees its cores at once. libgomp reads both when
# torch is imported, so they are set here, before any services.* module can
# import torch; a value already in the environment is kept. OPENMP_SET_BY_WEFT
# names the ones weft put there, so that a child that is not weft (a peer in
# `weft bench peers --peer-openmp own`) can start with its own defaults.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
OPENMP_SET_BY_WEFT = tuple(name for name in OPENMP_DEFAULTS if not env.is_set(name))
for _name in OPENMP_SET_BY_WEFT:
    env.put(_name, OPENMP_DEFAULTS[_name])

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
