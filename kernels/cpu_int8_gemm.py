"""weft's integer GEMMs for the int8 linear, one build per instruction set, and their one loader.

``GEMMS`` is the table: AMX int8 tiles (``csrc/cpu_amx_int8.cpp``), AVX-512 VNNI
(``csrc/cpu_vnni_int8.cpp``) and AVX2 alone (``csrc/cpu_avx2_int8.cpp``), each with
the CPU flags it needs, the build target, the ops namespace it registers and its
switch. Each is built like the other CPU kernels: ahead of time by
``python -m kernels.cpu_int8_gemm`` (``make install``; or the module of one,
``kernels.cpu_amx_int8`` ...), else on first use, cached by
``torch.utils.cpp_extension``. ``available(isa)`` says once per process whether
the int8 copy may use it: false, with the reason logged, on a CPU without its
flags, when the build cannot happen (or the AMX kernel is refused the tile
state), or when its switch (``WEFT_AMX_INT8``, ``WEFT_VNNI_INT8``,
``WEFT_AVX2_INT8``) is 0, to measure what it gains. The arithmetic of each (its
weight layout and calls) is in its own module: ``kernels.cpu_amx_int8``,
``kernels.cpu_vnni_int8``, ``kernels.cpu_avx2_int8``.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu_build import (
    AMX_INT8,
    AMX_INT8_FLAGS,
    AVX2_FLAGS,
    AVX512_VNNI,
    AVX512_VNNI_FLAGS,
    KernelUnavailable,
    build_command,
    build_for_flags,
    loaded_if_on,
    switch_on,
    target_isa,
)

CSRC = Path(__file__).parent / "csrc"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Int8Gemm:
    source: str  # in csrc/
    library: str  # the build's name
    namespace: str  # of torch.ops, as the source's TORCH_LIBRARY names it
    what: str  # in logs and errors
    flags: tuple[str, ...]  # /proc/cpuinfo flags the CPU needs
    target: Callable[[], tuple[str, list[str]]]  # (build name, compiler flags)
    switch: str  # its 0/1 switch in services/env.py
    refusal: str | None = None  # logged as a warning where available() is false though it loaded


# Keyed by the int8 copy's names for them (``Int8Weight.gemm``).
GEMMS: dict[str, Int8Gemm] = {
    "amx": Int8Gemm(
        "cpu_amx_int8.cpp",
        "weft_cpu_amx_int8",
        "weft_amx_int8",
        "the AMX int8 GEMM kernel",
        AMX_INT8_FLAGS,
        lambda: AMX_INT8,
        "WEFT_AMX_INT8",
        refusal="the AMX int8 GEMM was refused the tile state.",
    ),
    "vnni": Int8Gemm(
        "cpu_vnni_int8.cpp",
        "weft_cpu_vnni_int8",
        "weft_vnni_int8",
        "the VNNI int8 GEMM kernel",
        AVX512_VNNI_FLAGS,
        lambda: AVX512_VNNI,
        "WEFT_VNNI_INT8",
    ),
    "avx2": Int8Gemm(
        "cpu_avx2_int8.cpp",
        "weft_cpu_avx2_int8",
        "weft_avx2_int8",
        "the AVX2 int8 GEMM kernel",
        AVX2_FLAGS,
        target_isa,
        "WEFT_AVX2_INT8",
    ),
}

__all__ = ["GEMMS", "Int8Gemm", "KernelUnavailable", "available", "enabled_by_env", "load"]


def enabled_by_env(isa: str) -> bool:
    """Whether ``isa``'s switch is on ("1" or unset); ValueError for another value."""
    return switch_on(GEMMS[isa].switch)


@functools.cache
def load(isa: str):
    """Build (or load the cached build of) ``isa``'s kernel and return its ``torch.ops`` namespace;
    ``KernelUnavailable`` on a CPU without its flags or where the build fails."""
    gemm = GEMMS[isa]
    build_for_flags(gemm.library, CSRC / gemm.source, gemm.what, gemm.flags, gemm.target())
    return getattr(torch.ops, gemm.namespace)


@functools.cache
def available(isa: str) -> bool:
    """Whether the int8 copy may run its integer GEMMs on ``isa``'s kernel here."""
    gemm = GEMMS[isa]
    ops = loaded_if_on(gemm.switch, functools.partial(load, isa), gemm.what, logger)
    if ops is None:
        return False
    if not ops.available():
        if gemm.refusal is not None:
            logger.warning(gemm.refusal)
        return False
    return True


def build(isa: str) -> int:
    """``python -m kernels.<module>`` of one kernel: built where the CPU has its flags, else why not."""
    gemm = GEMMS[isa]
    return build_command(functools.partial(load, isa), gemm.what, gemm.target()[0])


if __name__ == "__main__":  # python -m kernels.cpu_int8_gemm [amx|vnni|avx2 ...]: the ones named, else all
    raise SystemExit(max(build(isa) for isa in (sys.argv[1:] or GEMMS)))
