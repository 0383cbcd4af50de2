"""The int8 linear's integer GEMM on AVX2 without VNNI (``csrc/cpu_avx2_int8.cpp``).

Built like the other CPU kernels: by ``python -m kernels.cpu_avx2_int8`` ahead
of time, else on first use, cached by ``torch.utils.cpp_extension`` (``kernels.cpu_int8_gemm``, the
loader of the three int8 GEMMs, builds and loads it).
``available()`` says once per process whether the int8 copy may use it: false,
with the reason logged, on a CPU without AVX2, when the build cannot happen,
or when ``WEFT_AVX2_INT8=0`` turns it off (to measure what it gains). It reads
the weight in the AMX kernel's packed layout (``kernels.cpu_amx_int8.pack_weight``),
every byte in [-127, 127] (``pack_weight`` here checks): the kernel multiplies
each weight byte by an activation's sign, and -128 has no opposite in int8.
Its torch twin is ``torch._int_mm(q, w.t())``: the same int32 integers, exactly.
``int8_linear`` is the int8 copy's whole layer for fp32 x in one call (rounding, GEMM and the
scaling back); its twins are the three passes it replaces, which give the same bits.
"""

from __future__ import annotations

import torch

from kernels import cpu_amx_int8, cpu_int8_gemm
from kernels.cpu_amx_int8 import fits  # the same layout, and the packing's rule
from kernels.cpu_build import KernelUnavailable

GEMM = "avx2"  # its row of cpu_int8_gemm.GEMMS, which builds and loads it
ENV_SWITCH = cpu_int8_gemm.GEMMS[GEMM].switch

__all__ = ["KernelUnavailable", "available", "fits", "int8_linear", "int8_matmul", "load", "pack_weight"]


def enabled_by_env() -> bool:
    return cpu_int8_gemm.enabled_by_env(GEMM)


def load():
    """``torch.ops.weft_avx2_int8``, built or loaded once (``cpu_int8_gemm.load``)."""
    return cpu_int8_gemm.load(GEMM)


def available() -> bool:
    """Whether the int8 copy may run its integer GEMMs on this kernel here."""
    return cpu_int8_gemm.available(GEMM)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``kernels.cpu_amx_int8.pack_weight`` of an int8 ``[N, K]`` weight with no -128 in it."""
    if weight.dtype == torch.int8 and bool((weight == -128).any()):
        raise ValueError("The AVX2 int8 GEMM takes weights in [-127, 127]; this one holds -128.")
    return cpu_amx_int8.pack_weight(weight)


def int8_matmul(q: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    """``q [M, K] @ W^T`` in int32, exact (``torch._int_mm(q, W.t())``'s integers), for
    ``packed_weight = pack_weight(W)``."""
    if not q.is_contiguous():
        q = q.contiguous()
    acc = torch.empty(q.shape[0], packed_weight.shape[0] * 16, dtype=torch.int32)
    load().int8_matmul(q, packed_weight, acc)
    return acc


def int8_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, col_scale: torch.Tensor, hadamard_block: int
) -> torch.Tensor:
    """``x [M, K]`` fp32 rotated in blocks of ``hadamard_block`` (0: not rotated) and rounded to
    int8 per row, times ``W`` (``packed_weight = pack_weight(W)``), scaled back by the row's scale
    and ``col_scale [N]``: ``[M, N]`` fp32, the bits of ``kernels.cpu_fused.quantize_rows_int8``,
    ``int8_matmul`` and ``kernels.cpu_fused.scale_int32`` one after the other."""
    out = torch.empty(x.shape[0], packed_weight.shape[0] * 16)
    load().int8_linear(x, packed_weight, col_scale, hadamard_block, out)
    return out


if __name__ == "__main__":
    raise SystemExit(cpu_int8_gemm.build(GEMM))
