"""The two passes around an int8 GEMM (``kernels.cpu_fused``): rows rounded to int8, and the
int32 product scaled back, against their torch twins, bit for bit; and the MLP's pass between its
two GEMMs, against those passes and SiLU-and-mul one after the other."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_fused
from kernels.reference import (
    hadamard_rows_ref,
    quantize_rows_int8_ref,
    scale_int32_ref,
    scale_silu_quantize_int8_ref,
)

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernels with"
)

DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 301])
@pytest.mark.parametrize("cols", [576, 77])  # SmolLM2's width, and one no vector width divides
@pytest.mark.parametrize("strided", [False, True])
def test_quantize_rows_matches_twin(generator, dtype, rows, cols, strided):
    wide = (torch.randn(rows, cols + 16, generator=generator) * 4).to(dtype)
    x = wide[:, 8 : 8 + cols] if strided else wide[:, :cols].contiguous()
    q, scale = cpu_fused.quantize_rows_int8(x)
    q_ref, scale_ref = quantize_rows_int8_ref(x)
    assert q.dtype == torch.int8 and q.is_contiguous() and scale.dtype == torch.float32
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert int(q.abs().amax(1).min()) == 127  # each row's largest element takes the whole range
    # The rounding error of an element is at most half a step of its row (bf16 values can sit on
    # the half step exactly; the margin is fp32 rounding of the check itself).
    err = (q.float() * scale[:, None] - x.float()).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-4)).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_and_non_finite_rows(dtype):
    x = torch.ones(4, 40, dtype=dtype)
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 39] = float("inf")  # the last element: past the vector loop's lanes
    q, scale = cpu_fused.quantize_rows_int8(x)
    q_ref, scale_ref = quantize_rows_int8_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(scale.nan_to_num(-1), scale_ref.nan_to_num(-1))
    assert scale[0] == 0 and not q[0].any()
    assert scale[1].isnan() and scale[2].isnan() and not q[1:3].any()  # NaN out, not garbage
    assert scale[3] == pytest.approx(1 / 127) and bool((q[3] == 127).all())


@pytest.mark.parametrize("dtype", DTYPES)
# Blocks of 64 take the register path (AVX-512 or AVX2, whichever the build has), 16 and 4 the
# plain loop; 1088 = 17 blocks.
@pytest.mark.parametrize(
    "cols, block", [(576, 64), (1536, 64), (640, 64), (2048, 64), (1088, 64), (80, 16), (12, 4)]
)
@pytest.mark.parametrize("strided", [False, True])
def test_rotated_rows_match_twin(generator, dtype, cols, block, strided):
    wide = (torch.randn(37, cols + 16, generator=generator) * 4).to(dtype)
    x = wide[:, 8 : 8 + cols] if strided else wide[:, :cols].contiguous()
    q, scale = cpu_fused.quantize_rows_int8(x, block)
    q_ref, scale_ref = quantize_rows_int8_ref(x, block)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_the_rotation_is_the_block_diagonal_hadamard_matrix(generator):
    """Blocks of 64 consecutive columns, each times Sylvester's Hadamard matrix / 8."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 64:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(5, 576, generator=generator)
    want = x.double() @ torch.block_diag(*[h / 8] * 9)
    torch.testing.assert_close(hadamard_rows_ref(x, 64).double(), want, atol=1e-5, rtol=1e-5)
    q, scale = cpu_fused.quantize_rows_int8(x, 64)
    torch.testing.assert_close(q.double() * scale[:, None].double(), want, atol=float(scale.max()), rtol=0)


def test_the_rotation_is_orthonormal_and_spreads_an_outlier(generator):
    x = torch.randn(6, 576, generator=generator, dtype=torch.float64)
    w = torch.randn(9, 576, generator=generator, dtype=torch.float64)
    rotated = hadamard_rows_ref(x, 64).double() @ hadamard_rows_ref(w, 64).double().T
    torch.testing.assert_close(rotated, x @ w.T, atol=1e-4, rtol=1e-5)
    spike = torch.zeros(1, 576)
    spike[0, 100] = 64.0
    spread = hadamard_rows_ref(spike, 64)
    assert int((spread != 0).sum()) == 64 and float(spread.abs().max()) == 8.0  # 64 / sqrt(64)


def test_rotation_shrinks_the_rounding_error_of_outlier_rows(generator):
    """Activations with a few large columns, as LLM activations have: the rotated rows round to
    int8 with a far smaller error in the product."""
    x = torch.randn(64, 576, generator=generator)
    x[:, [7, 300]] *= 40.0
    w = torch.randn(128, 576, generator=generator) * 0.05
    want = x @ w.T
    errors = {}
    for block in (0, 64):
        qx, sx = cpu_fused.quantize_rows_int8(x, block)
        qw, sw = quantize_rows_int8_ref(w, block)
        out = cpu_fused.scale_int32(torch._int_mm(qx, qw.t()), sx, sw, None, torch.float32)
        errors[block] = float((out - want).norm() / want.norm())
    assert errors[64] < errors[0] / 2, errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (64, 1536), (301, 45)])
def test_scale_int32_matches_twin(generator, dtype, with_bias, shape):
    rows, n = shape
    acc = torch.randint(-(2**26), 2**26, shape, dtype=torch.int32, generator=generator)
    row_scale = torch.rand(rows, generator=generator) * 1e-3
    col_scale = torch.rand(n, generator=generator) * 1e-2
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    out = cpu_fused.scale_int32(acc, row_scale, col_scale, bias, dtype)
    assert out.dtype == dtype and torch.equal(out, scale_int32_ref(acc, row_scale, col_scale, bias, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_scale_int32_takes_the_integers_as_float32_too(generator, dtype, with_bias):
    """oneDNN's int8 GEMM writes its integer products as float32: the same integers (as float32)
    scale to the same bits as the int32 they come from, and match the twin."""
    acc = torch.randint(-(2**26), 2**26, (67, 1536), dtype=torch.int32, generator=generator)
    row_scale = torch.rand(67, generator=generator) * 1e-3
    col_scale = torch.rand(1536, generator=generator) * 1e-2
    bias = torch.randn(1536, generator=generator).to(dtype) if with_bias else None
    from_int = cpu_fused.scale_int32(acc, row_scale, col_scale, bias, dtype)
    from_float = cpu_fused.scale_int32(acc.float(), row_scale, col_scale, bias, dtype)
    assert torch.equal(from_float, from_int)
    assert torch.equal(from_float, scale_int32_ref(acc.float(), row_scale, col_scale, bias, dtype))


def gate_up_product(generator, rows: int, n: int):
    """An int32 gate/up product [rows, 2n] with scales that make activations of a few units."""
    acc = torch.randint(-(2**20), 2**20, (rows, 2 * n), dtype=torch.int32, generator=generator)
    return (
        acc,
        torch.rand(rows, generator=generator) * 1e-3 + 1e-4,
        torch.rand(2 * n, generator=generator) * 1e-2,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, n, block", [(1, 1536, 64), (40, 1536, 64), (301, 64, 64), (7, 80, 16), (3, 12, 0)]
)
def test_the_mlp_pass_is_the_three_passes_in_one(generator, dtype, rows, n, block):
    acc, row_scale, col_scale = gate_up_product(generator, rows, n)
    q, scale = cpu_fused.scale_silu_quantize_int8(acc, row_scale, col_scale, block, dtype)
    gate_up = cpu_fused.scale_int32(acc, row_scale, col_scale, None, dtype)
    q_three, scale_three = cpu_fused.quantize_rows_int8(cpu_fused.silu_and_mul(gate_up), block)
    assert torch.equal(q, q_three) and torch.equal(scale, scale_three)
    # The twins' SiLU uses torch's exp, the kernels a polynomial: a rounding step apart at most.
    q_ref, scale_ref = scale_silu_quantize_int8_ref(acc, row_scale, col_scale, block, dtype)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-2, atol=0)
    assert int((q.int() - q_ref.int()).abs().max()) <= 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mlp_pass_takes_the_integers_as_float32_too(generator, dtype):
    acc, row_scale, col_scale = gate_up_product(generator, 40, 1536)
    from_int = cpu_fused.scale_silu_quantize_int8(acc, row_scale, col_scale, 64, dtype)
    from_float = cpu_fused.scale_silu_quantize_int8(acc.float(), row_scale, col_scale, 64, dtype)
    assert all(torch.equal(a, b) for a, b in zip(from_int, from_float))


def test_the_mlp_pass_gives_nan_rows_for_non_finite_products(generator):
    acc, row_scale, col_scale = gate_up_product(generator, 4, 64)
    row_scale[2] = float("inf")
    q, scale = cpu_fused.scale_silu_quantize_int8(acc, row_scale, col_scale, 64, torch.bfloat16)
    assert scale[2].isnan() and not q[2].any() and scale[[0, 1, 3]].isfinite().all()


def test_the_passes_around_an_integer_gemm_approximate_the_float_product(generator):
    x = torch.randn(16, 576, generator=generator)
    w = torch.randn(100, 576, generator=generator) * 0.05
    qx, sx = cpu_fused.quantize_rows_int8(x)
    qw, sw = quantize_rows_int8_ref(w)
    out = cpu_fused.scale_int32(torch._int_mm(qx, qw.t()), sx, sw, None, torch.float32)
    want = x @ w.T
    assert float((out - want).abs().max()) < 0.02 * float(want.abs().max())


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: cpu_fused.quantize_rows_int8(torch.ones(3, 4, 5)), r"x must be \[T, K\]"),
        (lambda: cpu_fused.quantize_rows_int8(torch.ones(3, 4, dtype=torch.float16)), "x must be one of"),
        (lambda: cpu_fused.quantize_rows_int8(torch.ones(4, 3).t()), "contiguous in its last dimension"),
        (lambda: cpu_fused.quantize_rows_int8(torch.ones(4, 48), 32), "hadamard_block must be 0 or one of"),
        (lambda: cpu_fused.quantize_rows_int8(torch.ones(4, 48), 64), "dividing K = 48"),
        (
            lambda: cpu_fused.scale_int32(
                torch.ones(2, 3, dtype=torch.float16), torch.ones(2), torch.ones(3), None, torch.float32
            ),
            "acc must be a contiguous .* int32 or float32",
        ),
        (
            lambda: cpu_fused.scale_int32(
                torch.ones(2, 3, dtype=torch.int32), torch.ones(3), torch.ones(3), None, torch.float32
            ),
            r"row_scale must be \[2\]",
        ),
        (
            lambda: cpu_fused.scale_int32(
                torch.ones(2, 3, dtype=torch.int32),
                torch.ones(2),
                torch.ones(3),
                torch.ones(3),
                torch.bfloat16,
            ),
            r"bias must be \[3\] torch.bfloat16",
        ),
        (
            lambda: cpu_fused.scale_int32(
                torch.ones(2, 3, dtype=torch.int32), torch.ones(2), torch.ones(3), None, torch.float16
            ),
            "output dtype must be",
        ),
        (
            lambda: cpu_fused.scale_silu_quantize_int8(
                torch.ones(2, 5, dtype=torch.int32), torch.ones(2), torch.ones(5), 0, torch.float32
            ),
            r"acc must be \[T, 2I\]",
        ),
        (
            lambda: cpu_fused.scale_silu_quantize_int8(
                torch.ones(2, 96, dtype=torch.int32), torch.ones(2), torch.ones(96), 64, torch.float32
            ),
            "dividing I = 48",
        ),
        (
            lambda: cpu_fused.scale_silu_quantize_int8(
                torch.ones(2, 8, dtype=torch.int32), torch.ones(2), torch.ones(4), 0, torch.float32
            ),
            r"col_scale must be \[8\]",
        ),
    ],
)
def test_bad_arguments_are_refused_clearly(call, message):
    with pytest.raises(ValueError, match=message):
        call()
