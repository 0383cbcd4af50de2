"""The int8 linear's integer GEMM on AMX int8 tiles (``csrc/cpu_amx_int8.cpp``).

Built, where the CPU has AMX (amx_tile, amx_int8), like the other CPU kernels: by
``python -m kernels.cpu_amx_int8`` ahead of time, else on first use, cached by
``torch.utils.cpp_extension`` (``kernels.cpu_int8_gemm``, the
loader of the three int8 GEMMs, builds and loads it). ``available()`` says once per process whether the
int8 copy may use it: false, with the reason logged, on a CPU without AMX int8, when
the build cannot happen or the kernel is refused the tile state, or when
``WEFT_AMX_INT8=0`` turns it off (to measure what it gains). Its torch twin is
``torch._int_mm(q, w.t())``: the same int32 integers, exactly.
"""

from __future__ import annotations

import torch

from kernels import cpu_int8_gemm
from kernels.cpu_build import KernelUnavailable

GEMM = "amx"  # its row of cpu_int8_gemm.GEMMS, which builds and loads it
ENV_SWITCH = cpu_int8_gemm.GEMMS[GEMM].switch

__all__ = ["KernelUnavailable", "available", "fits", "int8_matmul", "load", "pack_weight"]


def enabled_by_env() -> bool:
    return cpu_int8_gemm.enabled_by_env(GEMM)


def load():
    """``torch.ops.weft_amx_int8``, built or loaded once (``cpu_int8_gemm.load``)."""
    return cpu_int8_gemm.load(GEMM)


def available() -> bool:
    """Whether the int8 copy runs its integer GEMMs on this kernel here."""
    return cpu_int8_gemm.available(GEMM)


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: [N, K] on CPU with N % 16 == 0 and K % 64 == 0."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 64 == 0
        and weight.shape[1] > 0
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An int8 ``[N, K]`` weight in the tiles' B layout, ``[N / 16, K / 4, 16, 4]``: for each block
    of 16 rows, word ``p`` (K columns 4 p .. 4 p + 3) of each of its rows, 16 words to a line."""
    if weight.dtype != torch.int8 or not fits(weight):
        raise ValueError(
            f"pack_weight takes an int8 [N, K] CPU weight with N % 16 == 0 and K % 64 == 0, "
            f"got {weight.dtype} {list(weight.shape)}."
        )
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def int8_matmul(q: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    """``q [M, K] @ W^T`` in int32, exact (``torch._int_mm(q, W.t())``'s integers), for
    ``packed_weight = pack_weight(W)``."""
    if not q.is_contiguous():
        q = q.contiguous()
    rows = q.shape[0]
    acc = torch.empty((rows + 15) // 16 * 16, packed_weight.shape[0] * 16, dtype=torch.int32)
    load().int8_matmul(q, packed_weight, acc)
    return acc[:rows]


if __name__ == "__main__":
    raise SystemExit(cpu_int8_gemm.build(GEMM))
