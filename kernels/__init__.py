"""Triton kernels and their torch reference twins.

Kept import-light on purpose: transformers probes for a top-level package
named ``kernels`` and imports it while building models. The kernel modules
import triton; nothing here does.
"""


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``, as Triton parses it).

    Read from the environment rather than ``triton.knobs``, which older
    Triton releases lack; Triton reads it when a kernel module is imported.
    ``services.env`` is imported here, not above, to keep this package import-light.
    """
    from services import env

    return (env.get("TRITON_INTERPRET") or "").strip().lower() in ("1", "true", "on", "yes")
