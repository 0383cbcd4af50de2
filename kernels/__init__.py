"""Triton kernels and their torch reference twins.

Kept import-light on purpose: transformers probes for a top-level package
named ``kernels`` and imports it while building models. The kernel modules
import triton; nothing here does.
"""

import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``, as Triton parses it).

    Read from the environment rather than ``triton.knobs``, which older
    Triton releases lack; Triton reads it when a kernel module is imported.
    """
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
