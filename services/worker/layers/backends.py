"""Which attention backend an engine runs, chosen once when its worker starts.

- ``torch``: torch ops only. Decodes gather their K/V blocks into a padded
  tensor and run SDPA; prefills run SDPA (``attention.py``).
- ``cpu``: the torch backend with decodes in a compiled kernel that reads
  K/V in place through the block table (``kernels/cpu_attention.py``), and
  the linear layers' weights packed once for oneDNN (``linear.py``). The
  default on CPU; when the kernel cannot be built here (no compiler), the
  worker says why and runs ``torch``.
- ``triton``: Triton kernels for attention, cache writes, norms, rotary and
  the MLP activation (``triton_attention.py``); the default on CUDA.

``WEFT_ATTENTION_BACKEND`` forces one (``services.config.engine_args``).
"""

from __future__ import annotations

import logging

import torch

BACKENDS = ("torch", "cpu", "triton")

logger = logging.getLogger(__name__)


def check_backend(backend: str, device: torch.device) -> str:
    """The backend to run: ``backend`` if it can run on ``device``, ``torch`` in place of a
    ``cpu`` kernel that cannot be built, a ValueError that says why otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}; got {backend!r}.")
    if backend == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"The triton backend runs on CUDA devices (got {device.type}); on CPU, use the cpu or torch backend, "
            "or set TRITON_INTERPRET=1 before triton is imported to run the kernels interpreted (slow)."
        )
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(
                f"The cpu backend runs on CPU devices (got {device.type}); on CUDA, use triton or torch."
            )
        from kernels.cpu_attention import KernelUnavailable, load

        try:
            load()
        except KernelUnavailable as exc:
            logger.warning(
                "%s Decode attention falls back to the torch backend (gather + SDPA, slower).", exc
            )
            return "torch"
    return backend


def _interpreting() -> bool:
    from kernels import interpreting

    return interpreting()
