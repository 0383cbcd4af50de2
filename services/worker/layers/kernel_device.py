"""Which device a model is being built for, so its layers pick their kernels once, at construction.

The layers choose the compiled CPU kernels (``kernels.cpu_fused``) in their constructors, and
asking whether those exist builds them. A model built for a GPU must not: a compiler run at the
first start of every GPU host, warnings where there is no compiler, and the build lock for
nothing. ``building_for(device)`` names the target around a model's construction
(``model_loader.load_model``); without it, torch's default device decides (``torch.device(...)``
as a context manager sets it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from kernels import cpu_fused

_target: ContextVar[str | None] = ContextVar("weft_model_device", default=None)


@contextmanager
def building_for(device: torch.device | str) -> Iterator[None]:
    token = _target.set(torch.device(device).type)
    try:
        yield
    finally:
        _target.reset(token)


def target_device_type() -> str:
    target = _target.get()
    return target if target is not None else torch.get_default_device().type


def cpu_fused_for_model(dtype: torch.dtype | None = None) -> bool:
    """Whether a layer being built uses the compiled CPU kernels: only for a CPU model (and, given
    ``dtype``, one of the kernels' dtypes), and only then are they loaded (built) to find out."""
    if target_device_type() != "cpu":
        return False
    if dtype is not None and dtype not in cpu_fused.DTYPES:
        return False
    return cpu_fused.available()
