"""The int8 linear's integer GEMM on AVX-512 VNNI (``csrc/cpu_vnni_int8.cpp``).

Built, where the CPU has AVX-512 VNNI, like the other CPU kernels: by
``python -m kernels.cpu_vnni_int8`` ahead of time, else on first use, cached by
``torch.utils.cpp_extension``. ``available()`` says once per process whether the
int8 copy may use it: false, with the reason logged, on a CPU without AVX-512
VNNI, when the build cannot happen, or when ``WEFT_VNNI_INT8=0`` turns it off (to
measure what it gains). Its weight is packed as the AMX kernel's is
(``kernels.cpu_amx_int8.pack_weight``), with one int32 a row beside it
(``row_bias``). Its torch twin is ``torch._int_mm(q, w.t())``: the same int32
integers, exactly.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from kernels.cpu_amx_int8 import fits, pack_weight  # the same layout, and the packing's rule
from kernels.cpu_build import (
    AVX512_VNNI,
    AVX512_VNNI_FLAGS,
    KernelUnavailable,
    build_command,
    build_for_flags,
    loaded_if_on,
    switch_on,
)

SOURCE = Path(__file__).parent / "csrc" / "cpu_vnni_int8.cpp"
ENV_SWITCH = "WEFT_VNNI_INT8"  # "0" keeps the int8 copy on torch._int_mm; read by enabled_by_env()

logger = logging.getLogger(__name__)

__all__ = ["KernelUnavailable", "available", "fits", "int8_matmul", "load", "pack_weight", "row_bias"]


def enabled_by_env() -> bool:
    return switch_on(ENV_SWITCH)


@functools.cache
def load():
    """Build (or load the cached build of) the kernel and return ``torch.ops.weft_vnni_int8``;
    ``KernelUnavailable`` on a CPU without AVX-512 VNNI or where the build fails."""
    build_for_flags("weft_cpu_vnni_int8", SOURCE, "the VNNI int8 GEMM kernel", AVX512_VNNI_FLAGS, AVX512_VNNI)
    return torch.ops.weft_vnni_int8


@functools.cache
def available() -> bool:
    """Whether the int8 copy runs its integer GEMMs on this kernel here."""
    ops = loaded_if_on(ENV_SWITCH, load, "the VNNI int8 GEMM kernel", logger)
    return ops is not None and bool(ops.available())


def row_bias(weight: torch.Tensor) -> torch.Tensor:
    """``-128 *`` each row's sum of an int8 ``[N, K]`` weight, int32: where the kernel's sums
    start, since it multiplies ``q + 128`` (unsigned) by the weight."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"row_bias takes an int8 [N, K] weight, got {weight.dtype} {list(weight.shape)}.")
    return (weight.sum(dim=1, dtype=torch.int32) * -128).contiguous()


def int8_matmul(q: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``q [M, K] @ W^T`` in int32, exact (``torch._int_mm(q, W.t())``'s integers), for
    ``packed_weight = pack_weight(W)`` and ``bias = row_bias(W)``."""
    if not q.is_contiguous():
        q = q.contiguous()
    acc = torch.empty(q.shape[0], packed_weight.shape[0] * 16, dtype=torch.int32)
    load().int8_matmul(q, packed_weight, bias, acc)
    return acc


if __name__ == "__main__":
    raise SystemExit(build_command(load, "the VNNI int8 GEMM kernel", AVX512_VNNI[0]))
