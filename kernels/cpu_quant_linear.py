"""The compiled CPU kernels for weights kept packed (``csrc/cpu_quant_linear.cpp``).

Built like the CPU attention kernel (``kernels.cpu_attention``): with the
machine's compiler through ``torch.utils.cpp_extension`` by ``make install``
(``python -m kernels.cpu_quant_linear``), else on first use, for AVX2 + FMA
where the CPU has them. ``load()`` raises ``KernelUnavailable`` with the
reason when the build cannot happen; callers then use the torch twins in
``kernels.reference`` (``quant_linear_ref``, ``dequantize_packed_ref``).

Layouts and numerics are described in the C++ source: the weights rebuilt
equal the gguf package's dequantization exactly; sums are fp32.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.cpu_build import KernelUnavailable, build, target_isa

SOURCE = Path(__file__).parent / "csrc" / "cpu_quant_linear.cpp"

__all__ = ["KernelUnavailable", "dequantize_rows", "load", "quant_linear"]


@functools.cache
def load() -> None:
    """Build (or load the cached build of) the kernels and register ``torch.ops.weft_quant``."""
    build("weft_cpu_quant_linear", SOURCE, "the CPU quantized-linear kernel")


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K]`` fp32 ``@ W^T`` -> ``[M, N]`` fp32, W packed (int8 when ``mins`` is None, else int4)."""
    load()
    if out is None:
        out = torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
    torch.ops.weft_quant.quant_linear(x, qweight, scales, mins, group_size, out)
    return out


def dequantize_rows(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    start: int,
    count: int,
    in_features: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[start, start + count)`` of the packed W as fp32 ``[count, in_features]``."""
    load()
    if out is None:
        out = torch.empty(count, in_features, dtype=torch.float32)
    torch.ops.weft_quant.dequantize_rows(qweight, scales, mins, group_size, start, out)
    return out


if __name__ == "__main__":  # build ahead of first use (make install, the Docker image)
    load()
    print(f"built and loaded the CPU quantized-linear kernel ({target_isa()[0]})")
