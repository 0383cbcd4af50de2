"""An int8 dense copy of a weight, for batched steps on CPU (``--dense-copy-dtype int8``).

The weight ``[N, K]`` is rounded per output row to int8 with one fp32 scale
(``scale = amax(row) / 127``). At each call every row of x is rounded the same
way, the integer product runs as one int32 GEMM (``torch._int_mm``: AVX-512
VNNI or AVX2 integer dot products, about twice oneDNN's bf16 GEMM on the
machines measured, README "int8 dense copy"), and the int32 result is scaled
back by the two scales into x's dtype. Both passes around the GEMM are compiled
kernels (``kernels.cpu_fused``), with torch twins in ``kernels.reference``
where the kernels cannot be built.

Numerics: x and W each carry a relative rounding error of up to 1/254 of
their row's largest element, the same kind of rounding llama.cpp applies to
activations for its quantized matmuls; a row's result does not depend on the
rows beside it. Off by default: the model dtype's copy keeps HF parity.
"""

from __future__ import annotations

import torch

from kernels import cpu_fused
from kernels.reference import quantize_rows_int8_ref, scale_int32_ref


class Int8Weight:
    """``x W^T (+ b)`` with W and x rounded to int8 per row (see the module notes)."""

    def __init__(self, weight: torch.Tensor) -> None:
        q, scale = quantize_rows_int8_ref(weight.float())
        if not torch.isfinite(scale).all():
            raise ValueError("An int8 dense copy needs finite weights; this layer's hold a NaN or infinity.")
        self.qweight = q  # [N, K] int8
        self.scale = scale  # [N] fp32
        self.compiled = cpu_fused.available()

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.compiled:
            q, row_scale = cpu_fused.quantize_rows_int8(rows)
            acc = torch._int_mm(q, self.qweight.t())
            out = cpu_fused.scale_int32(acc, row_scale, self.scale, bias, x.dtype)
        else:
            q, row_scale = quantize_rows_int8_ref(rows)
            acc = torch._int_mm(q, self.qweight.t())
            out = scale_int32_ref(acc, row_scale, self.scale, bias, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)
