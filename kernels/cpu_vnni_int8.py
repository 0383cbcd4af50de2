"""The int8 linear's integer GEMM on AVX-512 VNNI (``csrc/cpu_vnni_int8.cpp``).

Built, where the CPU has AVX-512 VNNI, like the other CPU kernels: by
``python -m kernels.cpu_vnni_int8`` ahead of time, else on first use, cached by
``torch.utils.cpp_extension`` (``kernels.cpu_int8_gemm``, the
loader of the three int8 GEMMs, builds and loads it). ``available()`` says once per process whether the
int8 copy may use it: false, with the reason logged, on a CPU without AVX-512
VNNI, when the build cannot happen, or when ``WEFT_VNNI_INT8=0`` turns it off (to
measure what it gains). Its weight is packed as the AMX kernel's is
(``kernels.cpu_amx_int8.pack_weight``), with one int32 a row beside it
(``row_bias``). Its torch twin is ``torch._int_mm(q, w.t())``: the same int32
integers, exactly.
"""

from __future__ import annotations

import torch

from kernels import cpu_int8_gemm
from kernels.cpu_amx_int8 import fits, pack_weight  # the same layout, and the packing's rule
from kernels.cpu_build import KernelUnavailable

GEMM = "vnni"  # its row of cpu_int8_gemm.GEMMS, which builds and loads it
ENV_SWITCH = cpu_int8_gemm.GEMMS[GEMM].switch

__all__ = ["KernelUnavailable", "available", "fits", "int8_matmul", "load", "pack_weight", "row_bias"]


def enabled_by_env() -> bool:
    return cpu_int8_gemm.enabled_by_env(GEMM)


def load():
    """``torch.ops.weft_vnni_int8``, built or loaded once (``cpu_int8_gemm.load``)."""
    return cpu_int8_gemm.load(GEMM)


def available() -> bool:
    """Whether the int8 copy runs its integer GEMMs on this kernel here."""
    return cpu_int8_gemm.available(GEMM)


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
    raise SystemExit(cpu_int8_gemm.build(GEMM))
