"""An int8 dense copy of a weight, for batched steps on CPU (``--dense-copy-dtype int8``): kept
beside the model dtype's copy, it runs from ``services.config.dense_copy.INT8_MIN_ROWS`` rows on,
on weft's own AVX-512 VNNI and AVX2 GEMMs every step of the dense copy, and on AMX int8 tiles up
to ``AMX_INT8_MAX_ROWS`` (``Int8Weight.takes``).

The weight ``[N, K]`` is rotated and then rounded per output row to int8 with
one fp32 scale (``scale = amax(row) / 127``). At each call every row of x is
rotated and rounded the same way, the integer product runs as one integer GEMM,
and its result is scaled back by the two scales into x's dtype. The GEMM is
``torch._int_mm``, or weft's own GEMMs, which stream the weight at close to
the read bandwidth at a decode step's rows: on AVX-512 VNNI
``kernels.cpu_vnni_int8`` (where ``torch._int_mm`` read it at half that), on
AMX int8 tiles ``kernels.cpu_amx_int8``, on AVX2 without VNNI
``kernels.cpu_avx2_int8`` (``torch._int_mm`` is a scalar loop there, 30-60x
slower than the fp32 GEMM); or, on AMX where that
kernel cannot be built oneDNN's int8 matmul on a prepacked weight
(``torch.ops.onednn.qlinear_pointwise`` with unit scales: its fp32 result holds
the same integers), 1.1-1.6x ``torch._int_mm`` there from 64 rows on (README,
"On an AMX machine"); all give the same numbers. Both passes around the GEMM are
compiled kernels (``kernels.cpu_fused``), with torch twins in
``kernels.reference`` where the kernels cannot be built.

The rotation is an orthonormal Walsh-Hadamard transform over blocks of 64
columns (``kernels.reference.hadamard_rows_ref``); applied to x and W alike it
leaves ``x W^T`` as it was, but spreads each large activation column over 64,
so a row's amax, and with it the rounding step, shrinks (the QuaRot idea,
done per layer at run time rather than folded into the model). Measured on
the repository's text: rounding costs 0.042 nats a token unrotated, 0.0045
rotated, against the bf16 copy (README). A row's result does not depend on the
rows beside it. Auto keeps it only with a bf16 model dtype on the CPUs where it
pays (``services.config.dense_copy``); fp32 runs keep HF parity on the model
dtype's copy.
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_amx_int8, cpu_avx2_int8, cpu_fused, cpu_vnni_int8
from kernels.cpu_caps import cpu_flags
from kernels.reference import HADAMARD_BLOCKS, quantize_rows_int8_ref, scale_int32_ref
from services.config.dense_copy import AMX_INT8_MAX_ROWS, INT8_MIN_ROWS

INT8_GEMMS = ("int_mm", "onednn", "amx", "vnni", "avx2")


def default_int8_gemm(
    flags: set[str] | None = None,
    amx_kernel: bool | None = None,
    vnni_kernel: bool | None = None,
    avx2_kernel: bool | None = None,
) -> str:
    """Where the CPU has AMX int8 tiles: ``amx`` (weft's kernel, ``kernels.cpu_amx_int8``) where it
    builds (``amx_kernel``: whether it does, asked when None), else ``onednn`` where torch has
    oneDNN's int8 linear ops (there ``torch._int_mm`` does not use the tiles and ran slower than
    the bf16 GEMM). Else, with AVX-512 VNNI, ``vnni`` (weft's kernel, ``kernels.cpu_vnni_int8``)
    where it builds (``vnni_kernel``, likewise). Else, with AVX2, ``avx2`` (weft's kernel,
    ``kernels.cpu_avx2_int8``: ``torch._int_mm`` runs a scalar loop there) where it builds
    (``avx2_kernel``, likewise). Elsewhere ``int_mm``."""
    if flags is None:
        return _this_machines_int8_gemm()
    if "amx_int8" not in flags:
        if "avx512_vnni" not in flags:
            if "avx2" not in flags:
                return "int_mm"
            if avx2_kernel is None:
                avx2_kernel = cpu_avx2_int8.available()
            return "avx2" if avx2_kernel else "int_mm"
        if vnni_kernel is None:
            vnni_kernel = cpu_vnni_int8.available()
        return "vnni" if vnni_kernel else "int_mm"
    if amx_kernel is None:
        amx_kernel = cpu_amx_int8.available()
    if amx_kernel:
        return "amx"
    return "onednn" if _onednn_ops_present() else "int_mm"


@functools.cache
def _this_machines_int8_gemm() -> str:
    """Once a process: a model's layers would otherwise read /proc/cpuinfo one by one."""
    return default_int8_gemm(cpu_flags())


def _onednn_ops_present() -> bool:
    onednn = getattr(torch.ops, "onednn", None)
    return onednn is not None and hasattr(onednn, "qlinear_prepack") and hasattr(onednn, "qlinear_pointwise")


def int_mm_is_a_scalar_loop(flags: set[str] | None = None) -> bool:
    """Whether ``torch._int_mm`` runs a scalar loop here (30-60x slower than the fp32 GEMM): on a CPU
    without VNNI or AMX int8 dot products."""
    flags = cpu_flags() if flags is None else flags
    return not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


def int8_copy_runs_here(flags: set[str] | None = None, gemm: str | None = None) -> bool:
    """Whether an int8 copy's GEMM (``gemm``; ``default_int8_gemm()``'s when None) is worth running
    here: weft's own kernel, or ``torch._int_mm`` on integer dot products; not ``torch._int_mm``'s
    scalar loop (an AVX2 CPU where weft's AVX2 kernel could not be built or was turned off)."""
    if gemm is None:
        gemm = default_int8_gemm() if flags is None else default_int8_gemm(flags)
    return gemm != "int_mm" or not int_mm_is_a_scalar_loop(flags)


@functools.cache
def onednn_int8_exact(flags: frozenset[str] | None = None) -> bool:
    """Whether oneDNN's int8 matmul gives exact integers here: on VNNI (``vpdpbusd``) or AMX int8
    tiles. With AVX2 alone it multiplies by ``vpmaddubsw``, whose int16 pair sums saturate (seen:
    -72,687 for -74,650 on a Zen 3)."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def hadamard_block_for(k: int) -> int:
    """The largest Walsh-Hadamard block that divides a row of ``k`` (0: none does)."""
    return next((block for block in sorted(HADAMARD_BLOCKS, reverse=True) if k % block == 0), 0)


class Int8Weight:
    """``x W^T (+ b)`` with W and x rounded to int8 per row (see the module notes).
    ``gemm``: ``int_mm``, ``onednn``, ``amx`` or ``vnni`` (``default_int8_gemm()`` when None; for a
    shape weft's kernels do not take, ``amx`` turns into ``onednn`` and ``vnni`` into ``int_mm``)."""

    def __init__(self, weight: torch.Tensor, gemm: str | None = None) -> None:
        gemm = default_int8_gemm() if gemm is None else gemm
        if gemm not in INT8_GEMMS:
            raise ValueError(f"gemm must be one of {', '.join(INT8_GEMMS)}, got {gemm!r}.")
        if gemm == "onednn" and not _onednn_ops_present():
            raise ValueError(
                "gemm 'onednn' needs torch's oneDNN int8 linear ops (torch.ops.onednn), absent here."
            )
        if gemm == "onednn" and not onednn_int8_exact():
            raise ValueError(
                "gemm 'onednn' needs a CPU with VNNI or AMX int8 dot products: without them oneDNN's "
                "int8 matmul sums byte products into saturating int16 pairs, and its results part "
                "from the exact integers."
            )
        if gemm == "amx" and not cpu_amx_int8.available():
            raise ValueError("gemm 'amx' needs AMX int8 tiles and weft's AMX int8 kernel, absent here.")
        if gemm == "vnni" and not cpu_vnni_int8.available():
            raise ValueError("gemm 'vnni' needs AVX-512 VNNI and weft's VNNI int8 kernel, absent here.")
        if gemm == "avx2" and not cpu_avx2_int8.available():
            raise ValueError("gemm 'avx2' needs AVX2 and weft's AVX2 int8 kernel, absent here.")
        self.hadamard_block = hadamard_block_for(weight.shape[1])
        q, scale = quantize_rows_int8_ref(weight.float(), self.hadamard_block)
        if not torch.isfinite(scale).all():
            raise ValueError("An int8 dense copy needs finite weights; this layer's hold a NaN or infinity.")
        if gemm == "amx" and not cpu_amx_int8.fits(q):
            # A shape the tiles do not take (K % 64, N % 16): oneDNN's tiles where torch has them.
            gemm = "onednn" if _onednn_ops_present() else "int_mm"
        if gemm in ("vnni", "avx2") and not cpu_vnni_int8.fits(q):
            gemm = "int_mm"
        self.gemm = gemm
        self.scale = scale  # [N] fp32
        self.out_features, self._in_features = q.shape
        if gemm == "amx":
            self._qweight = cpu_amx_int8.pack_weight(q)  # the tiles' layout, made once
        elif gemm == "vnni":
            self._qweight = cpu_vnni_int8.pack_weight(q)  # the same layout, and its sums' start
            self._row_bias = cpu_vnni_int8.row_bias(q)
        elif gemm == "avx2":
            self._qweight = cpu_avx2_int8.pack_weight(q)  # the same layout, no sums
        elif gemm == "int_mm":
            self._qweight_t = q.t()  # the GEMM's [K, N] view, made once rather than a call
        else:
            # The tiles' blocked layout, made once (the plain copy is not kept). Unit scales and
            # zero points make the op's fp32 output each int32 product converted to fp32, the
            # rounding the scaling kernels apply to torch._int_mm's int32 (exact below 2**24).
            packed = torch.ops.onednn.qlinear_prepack(q, None)
            unit_scale, zero_point = torch.ones(q.shape[0]), torch.zeros(q.shape[0], dtype=torch.long)
            # Everything of the op's call after x and its scale and zero point: the weight, its
            # scales and zero points, no bias, output scale 1 and zero point 0, fp32, no post-op.
            self._onednn_args = (packed, unit_scale, zero_point, None, 1.0, 0, torch.float32, "none", [], "")
        # The compiled passes, or their twins where the kernels cannot be built.
        compiled = cpu_fused.available()
        self._quantize = cpu_fused.quantize_rows_int8 if compiled else quantize_rows_int8_ref
        self._scale = cpu_fused.scale_int32 if compiled else scale_int32_ref
        # The AVX2 kernel's whole layer in one call for fp32 x (the same bits as the three passes).
        self._one_call = cpu_avx2_int8.load().int8_linear.default if gemm == "avx2" else None

    @property
    def one_call(self) -> bool:
        """Whether ``linear`` runs fp32 x without a bias as one kernel call (rounding, GEMM and
        scaling in one pass: ``kernels.cpu_avx2_int8.int8_linear``)."""
        return self._one_call is not None

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs on this copy rather than the model dtype's:
        every one on weft's VNNI and AVX2 GEMMs, up to ``AMX_INT8_MAX_ROWS`` on its AMX GEMM, from
        ``INT8_MIN_ROWS`` on the others."""
        if self.gemm in ("vnni", "avx2"):
            return True
        return rows <= AMX_INT8_MAX_ROWS if self.gemm == "amx" else rows >= INT8_MIN_ROWS

    @property
    def nbytes(self) -> int:
        sums = self._row_bias.nbytes if self.gemm == "vnni" else 0  # where the VNNI GEMM's sums start
        return self.out_features * self._in_features + self.scale.nbytes + sums

    def integer_product(self, q: torch.Tensor) -> torch.Tensor:
        """``q [rows, K]`` int8 times the int8 weight: ``[rows, N]`` int32 (``int_mm``, ``amx``, ``vnni``, ``avx2``) or
        float32 holding the same integers (``onednn``)."""
        if self.gemm == "amx":
            return cpu_amx_int8.int8_matmul(q, self._qweight)
        if self.gemm == "vnni":
            return cpu_vnni_int8.int8_matmul(q, self._qweight, self._row_bias)
        if self.gemm == "avx2":
            return cpu_avx2_int8.int8_matmul(q, self._qweight)
        if self.gemm == "int_mm":
            return torch._int_mm(q, self._qweight_t)
        return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, *self._onednn_args)

    def rounded_product(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., K] rotated and rounded, times the int8 weight: (``integer_product``'s result
        [rows, N], x's row scales [rows])."""
        q, row_scale = self._quantize(x.reshape(-1, x.shape[-1]), self.hadamard_block)
        return self.integer_product(q), row_scale

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._one_call is not None and bias is None and x.dtype == torch.float32 and x.stride(-1) == 1:
            rows = x.reshape(-1, self._in_features)
            out = torch.empty(rows.shape[0], self.out_features)
            self._one_call(rows, self._qweight, self.scale, self.hadamard_block, out)
            return out.view(*x.shape[:-1], self.out_features)
        acc, row_scale = self.rounded_product(x)
        out = self._scale(acc, row_scale, self.scale, bias, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def linear_rounded(
        self, q: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """``linear`` of an x already rotated and rounded for this weight (``q [rows, K]`` int8
        with its row scales), in ``dtype``."""
        return self._scale(self.integer_product(q), row_scale, self.scale, bias, dtype)
