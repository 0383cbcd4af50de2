"""An int8 dense copy of a weight, for steps of many rows on CPU (``--dense-copy-dtype int8``):
kept beside the model dtype's copy, it runs from ``services.config.dense_copy.INT8_MIN_ROWS`` rows on.

The weight ``[N, K]`` is rotated and then rounded per output row to int8 with
one fp32 scale (``scale = amax(row) / 127``). At each call every row of x is
rotated and rounded the same way, the integer product runs as one int32 GEMM
(``torch._int_mm``: AVX-512 VNNI or AVX2 integer dot products, about twice
oneDNN's bf16 GEMM here, README "int8 dense copy"), and the int32 result is
scaled back by the two scales into x's dtype. Both passes around the GEMM are
compiled kernels (``kernels.cpu_fused``), with torch twins in
``kernels.reference`` where the kernels cannot be built.

The rotation is an orthonormal Walsh-Hadamard transform over blocks of 64
columns (``kernels.reference.hadamard_rows_ref``); applied to x and W alike it
leaves ``x W^T`` as it was, but spreads each large activation column over 64,
so a row's amax, and with it the rounding step, shrinks (the QuaRot idea,
done per layer at run time rather than folded into the model). Measured on
the repository's text: rounding costs 0.042 nats a token unrotated, 0.0045
rotated, against the bf16 copy (README). A row's result does not depend on the
rows beside it. Off by default: the model dtype's copy keeps HF parity.
"""

from __future__ import annotations

import torch

from kernels import cpu_fused
from kernels.reference import HADAMARD_BLOCKS, quantize_rows_int8_ref, scale_int32_ref


def hadamard_block_for(k: int) -> int:
    """The largest Walsh-Hadamard block that divides a row of ``k`` (0: none does)."""
    return next((block for block in sorted(HADAMARD_BLOCKS, reverse=True) if k % block == 0), 0)


class Int8Weight:
    """``x W^T (+ b)`` with W and x rounded to int8 per row (see the module notes)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.hadamard_block = hadamard_block_for(weight.shape[1])
        q, scale = quantize_rows_int8_ref(weight.float(), self.hadamard_block)
        if not torch.isfinite(scale).all():
            raise ValueError("An int8 dense copy needs finite weights; this layer's hold a NaN or infinity.")
        self.qweight = q  # [N, K] int8
        self._qweight_t = q.t()  # the GEMM's [K, N] view, made once rather than a call
        self.scale = scale  # [N] fp32
        # The compiled passes, or their twins where the kernels cannot be built.
        compiled = cpu_fused.available()
        self._quantize = cpu_fused.quantize_rows_int8 if compiled else quantize_rows_int8_ref
        self._scale = cpu_fused.scale_int32 if compiled else scale_int32_ref

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def int32_product(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the int32 GEMM result [rows, N], x's row scales [rows]) for x [..., K]."""
        q, row_scale = self._quantize(x.reshape(-1, x.shape[-1]), self.hadamard_block)
        return torch._int_mm(q, self._qweight_t), row_scale

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        acc, row_scale = self.int32_product(x)
        out = self._scale(acc, row_scale, self.scale, bias, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def linear_rounded(
        self, q: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """``linear`` of an x already rotated and rounded for this weight (``q [rows, K]`` int8
        with its row scales), in ``dtype``."""
        return self._scale(torch._int_mm(q, self._qweight_t), row_scale, self.scale, bias, dtype)
