"""The int8 dense copy's integer GEMMs: ``torch._int_mm``, oneDNN's int8 matmul on a prepacked
weight (the AMX tiles where the CPU has them) and weft's own, on CPUs with AMX int8 tiles
(``kernels.cpu_amx_int8``), AVX-512 VNNI (``kernels.cpu_vnni_int8``) or AVX2 alone
(``kernels.cpu_avx2_int8``). All give the same
numbers: oneDNN falls back to the dot products the CPU has, and weft's kernels run only where
their instructions are."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_amx_int8, cpu_avx2_int8, cpu_vnni_int8
from kernels.cpu_build import cpu_flags
from services.worker.layers import int8_linear
from services.worker.layers.int8_linear import Int8Weight, default_int8_gemm

AMX = pytest.mark.skipif(not cpu_amx_int8.available(), reason="needs AMX int8 tiles and weft's AMX kernel")
VNNI = pytest.mark.skipif(not cpu_vnni_int8.available(), reason="needs AVX-512 VNNI and weft's VNNI kernel")
AVX2 = pytest.mark.skipif(not cpu_avx2_int8.available(), reason="needs AVX2 and weft's AVX2 kernel")


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(7)


SHAPES = [(1536, 576), (576, 1536), (960, 576), (49152, 576)]


def gemm_cases():
    """Every GEMM at every shape in fp32 and bf16, but oneDNN's int8 matmul without AMX int8
    tiles (never chosen there, and its fallback took 450 s for the LM head's shape on Zen 4) at one
    small shape, and not at all without VNNI (refused there: it saturates). The LM head's shape in
    fp32 alone: the dtype changes only the rounding in and the scaling out, which are the same code
    at every width, and its reference (``torch._int_mm``) is a scalar loop on AVX2 (seconds a call
    at 49152 columns)."""
    has_amx_int8 = "amx_int8" in cpu_flags()
    for shape in SHAPES:
        dtypes = [torch.float32] if shape[0] > 4096 else [torch.float32, torch.bfloat16]
        for dtype in dtypes:
            name = f"{str(dtype).removeprefix('torch.')}-{shape[0]}x{shape[1]}"
            if int8_linear.onednn_int8_exact() and (has_amx_int8 or shape == (960, 576)):
                yield pytest.param("onednn", shape, dtype, id=f"onednn-{name}")
            yield pytest.param("amx", shape, dtype, marks=AMX, id=f"amx-{name}")
            yield pytest.param("vnni", shape, dtype, marks=VNNI, id=f"vnni-{name}")
            yield pytest.param("avx2", shape, dtype, marks=AVX2, id=f"avx2-{name}")


@torch.inference_mode()
@pytest.mark.parametrize("gemm, shape, dtype", list(gemm_cases()))
def test_each_gemm_gives_the_int_mm_gemms_numbers(generator, gemm, dtype, shape):
    n, k = shape
    weight = torch.randn(n, k, generator=generator) * 0.05
    weight[:, 11] *= 30.0  # an outlier column, as the default model's activations have
    by_int_mm, by_onednn = Int8Weight(weight, gemm="int_mm"), Int8Weight(weight, gemm=gemm)
    assert by_onednn.gemm == gemm
    # the int8 weight and its row scales; the VNNI GEMM's sums start at one more int32 a row
    assert by_int_mm.nbytes == n * k + 4 * n
    assert by_onednn.nbytes == n * k + (8 if gemm == "vnni" else 4) * n
    bias = torch.randn(n, generator=generator).to(dtype)
    # Row tiles and chunks are the same code at every width: the LM head's 49152 columns (3,072
    # column blocks over the threads) at the decode steps' row counts; 301 rows at the others.
    for rows in (1, 7, 32) if n > 4096 else (1, 7, 32, 301):
        x = (torch.randn(rows, k, generator=generator) * 2).to(dtype)
        q, scale = by_int_mm._quantize(x, by_int_mm.hadamard_block)
        integers = by_int_mm.integer_product(q)
        floats = by_onednn.integer_product(q)
        assert integers.dtype == torch.int32
        assert floats.dtype == (torch.float32 if gemm == "onednn" else torch.int32)
        assert torch.equal(floats.to(torch.int32), integers)
        for b in (None, bias):
            got = by_onednn.linear(x, b)
            assert got.dtype == dtype and torch.equal(got, by_int_mm.linear(x, b))
        # The MLP's path: an x already rounded.
        assert torch.equal(
            by_onednn.linear_rounded(q, scale, None, dtype), by_int_mm.linear_rounded(q, scale, None, dtype)
        )


def test_the_gemm_is_chosen_by_the_cpus_flags(monkeypatch):
    assert default_int8_gemm({"avx512_vnni", "avx512_bf16"}, vnni_kernel=True) == "vnni"
    assert default_int8_gemm({"avx512_vnni", "avx512_bf16"}, vnni_kernel=False) == "int_mm"
    assert default_int8_gemm({"avx2"}, vnni_kernel=True, avx2_kernel=True) == "avx2"
    assert default_int8_gemm({"avx2"}, vnni_kernel=True, avx2_kernel=False) == "int_mm"
    assert default_int8_gemm({"sse4_2"}, avx2_kernel=True) == "int_mm"
    # AVX-512 VNNI comes first where the CPU has it.
    assert default_int8_gemm({"avx2", "avx512_vnni"}, vnni_kernel=True, avx2_kernel=True) == "vnni"
    amx = {"amx_tile", "amx_int8", "amx_bf16"}
    assert default_int8_gemm(amx, amx_kernel=True) == "amx"
    assert default_int8_gemm(amx, amx_kernel=False) == "onednn"
    monkeypatch.setattr(int8_linear, "_onednn_ops_present", lambda: False)
    assert default_int8_gemm({"amx_tile", "amx_int8"}, amx_kernel=False) == "int_mm"
    with pytest.raises(ValueError, match="needs torch's oneDNN int8 linear ops"):
        Int8Weight(torch.ones(4, 64), gemm="onednn")


def test_an_int8_copy_runs_where_its_gemm_is_not_a_scalar_loop():
    """torch._int_mm without VNNI or AMX int8 dot products is a scalar loop: no int8 copy on it."""
    assert int8_linear.int8_copy_runs_here({"avx2", "fma"}, gemm="avx2")
    assert not int8_linear.int8_copy_runs_here({"avx2", "fma"}, gemm="int_mm")
    assert int8_linear.int8_copy_runs_here({"avx2", "avx512_vnni"}, gemm="int_mm")
    assert int8_linear.int8_copy_runs_here({"amx_tile", "amx_int8"}, gemm="onednn")


def test_onednn_is_refused_where_its_int8_matmul_saturates(monkeypatch):
    assert int8_linear.onednn_int8_exact(frozenset({"avx2", "avx512_vnni"}))
    assert int8_linear.onednn_int8_exact(frozenset({"avx2", "avx_vnni"}))
    assert not int8_linear.onednn_int8_exact(frozenset({"avx2", "fma"}))
    monkeypatch.setattr(int8_linear, "onednn_int8_exact", lambda flags=None: False)
    with pytest.raises(ValueError, match="gemm 'onednn' needs a CPU with VNNI or AMX"):
        Int8Weight(torch.ones(4, 64), gemm="onednn")


def test_the_rows_each_gemm_takes():
    """weft's AMX GEMM takes a dense copy's steps up to AMX_INT8_MAX_ROWS (the bf16 copy the
    longer ones), its VNNI and AVX2 GEMMs all of them; the others from INT8_MIN_ROWS on (the model dtype's
    copy the shorter ones)."""
    from services.config.dense_copy import AMX_INT8_MAX_ROWS, INT8_MIN_ROWS

    by_int_mm = Int8Weight(torch.randn(32, 64), gemm="int_mm")
    assert not by_int_mm.takes(INT8_MIN_ROWS - 1) and by_int_mm.takes(INT8_MIN_ROWS) and by_int_mm.takes(4096)
    if cpu_amx_int8.available():
        by_amx = Int8Weight(torch.randn(32, 64), gemm="amx")
        assert by_amx.takes(1) and by_amx.takes(AMX_INT8_MAX_ROWS) and not by_amx.takes(AMX_INT8_MAX_ROWS + 1)
    if cpu_vnni_int8.available():
        by_vnni = Int8Weight(torch.randn(32, 64), gemm="vnni")
        assert by_vnni.takes(1) and by_vnni.takes(INT8_MIN_ROWS - 1) and by_vnni.takes(4096)
    if cpu_avx2_int8.available():
        by_avx2 = Int8Weight(torch.randn(32, 64), gemm="avx2")
        assert by_avx2.takes(1) and by_avx2.takes(INT8_MIN_ROWS - 1) and by_avx2.takes(4096)


@AMX
def test_a_shape_the_tiles_do_not_take_runs_on_onednn():
    weight = torch.randn(40, 96)  # N % 16 and K % 64 both off
    assert Int8Weight(weight, gemm="amx").gemm == "onednn"


@VNNI
def test_a_shape_the_vnni_packing_does_not_take_runs_on_int_mm():
    weight = torch.randn(40, 96)
    assert Int8Weight(weight, gemm="vnni").gemm == "int_mm"


@AVX2
def test_a_shape_the_avx2_packing_does_not_take_runs_on_int_mm():
    weight = torch.randn(40, 96)
    assert Int8Weight(weight, gemm="avx2").gemm == "int_mm"


@AVX2
@torch.inference_mode()
def test_the_avx2_gemm_holds_a_weight_rows_extremes():
    """The rounding gives each weight row's largest magnitude as +-127, never -128 (which the
    AVX2 kernel cannot take): a row of one sign and an outlier come out exact."""
    weight = torch.full((16, 64), -0.5)
    weight[3, 7] = -40.0
    weight[5] = torch.linspace(-1.0, 1.0, 64)
    by_int_mm, by_avx2 = Int8Weight(weight, gemm="int_mm"), Int8Weight(weight, gemm="avx2")
    x = torch.randn(5, 64) * 3
    assert torch.equal(by_avx2.linear(x, None), by_int_mm.linear(x, None))


def test_the_amx_gemm_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(cpu_amx_int8, "available", lambda: False)
    with pytest.raises(ValueError, match="gemm 'amx' needs AMX int8 tiles"):
        Int8Weight(torch.ones(16, 64), gemm="amx")


def test_the_vnni_gemm_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(cpu_vnni_int8, "available", lambda: False)
    with pytest.raises(ValueError, match="gemm 'vnni' needs AVX-512 VNNI"):
        Int8Weight(torch.ones(16, 64), gemm="vnni")


def test_the_avx2_gemm_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(cpu_avx2_int8, "available", lambda: False)
    with pytest.raises(ValueError, match="gemm 'avx2' needs AVX2"):
        Int8Weight(torch.ones(16, 64), gemm="avx2")


def test_an_unknown_gemm_is_refused():
    with pytest.raises(ValueError, match="gemm must be one of int_mm, onednn, amx, vnni, avx2, got 'mkl'"):
        Int8Weight(torch.ones(4, 64), gemm="mkl")
