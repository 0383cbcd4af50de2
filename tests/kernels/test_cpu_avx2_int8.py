"""weft's integer GEMM on AVX2 (``kernels.cpu_avx2_int8``) against its twin, an exact matmul of the
same int8 tensors: exact, at every row count its register tiles distinguish (one to four rows a
tile, strips of up to four blocks for one row and two for two, the chunks of 192 rows a prefill goes through), for
weights of one to many blocks of 16 rows, on one thread and two; and the weight range it needs.
``int8_linear`` (a layer in one call: rounding, GEMM, scaling back) against the twins of the three
passes it replaces, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_avx2_int8
from kernels.reference import quantize_rows_int8_ref, scale_int32_ref

AVX2 = pytest.mark.skipif(not cpu_avx2_int8.available(), reason="needs AVX2 and weft's AVX2 kernel")


def exact(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The integer product, taken in fp64: every partial sum is an integer far below 2**53 (at most
    K * 128 * 128), so exact in any order, and BLAS runs it (torch's int64 matmul is a scalar loop)."""
    return (q.double() @ w.double().t()).to(torch.int32)


def product(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_avx2_int8.int8_matmul(q, cpu_avx2_int8.pack_weight(w))


@AVX2
@torch.inference_mode()
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n, k", [(16, 64), (48, 128), (80, 576), (576, 1536), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 32, 191, 192, 193, 400])
def test_the_kernel_gives_the_integer_product(torch_threads, n, k, rows):
    generator = torch.Generator().manual_seed(rows * 7919 + n + k)
    q = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=generator)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    acc = product(q, w)
    assert acc.dtype == torch.int32 and acc.shape == (rows, n) and acc.is_contiguous()
    assert torch.equal(acc, exact(q, w))


@AVX2
@torch.inference_mode()
def test_extreme_values_sum_exactly():
    """|q| = 128 against |w| = 127 is the largest pair of products vpmaddubsw sums into an int16
    (2 x 16,256): it must not saturate, at either sign of either side."""
    q = torch.full((7, 1536), -128, dtype=torch.int8)
    q[3] = 127
    q[5, ::2] = 127  # pairs of mixed signs
    w = torch.full((32, 1536), -127, dtype=torch.int8)
    w[1] = 127
    w[2, 1::2] = 127
    acc = product(q, w)
    assert torch.equal(acc, exact(q, w))
    assert acc[0, 0].item() == 128 * 127 * 1536 and acc[0, 1].item() == -128 * 127 * 1536
    assert acc[3, 1].item() == 127 * 127 * 1536


@AVX2
@torch.inference_mode()
def test_a_strided_q_is_made_contiguous():
    q = torch.randint(-128, 128, (8, 256), dtype=torch.int8)[:, :128]
    w = torch.randint(-127, 128, (16, 128), dtype=torch.int8)
    assert torch.equal(product(q, w), exact(q, w))


def three_passes(x: torch.Tensor, w: torch.Tensor, col_scale: torch.Tensor, block: int) -> torch.Tensor:
    """The twins of rounding x, the integer GEMM and the scaling back, one after the other."""
    q, row_scale = quantize_rows_int8_ref(x, block)
    return scale_int32_ref(exact(q, w), row_scale, col_scale, None, torch.float32)


@AVX2
@torch.inference_mode()
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
@pytest.mark.parametrize(
    "n, k, block", [(16, 64, 0), (48, 128, 4), (80, 576, 64), (576, 1536, 64), (64, 128, 16)]
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 193])
def test_the_one_call_linear_gives_the_three_passes_bits(torch_threads, n, k, block, rows):
    generator = torch.Generator().manual_seed(rows * 31 + n + k + block)
    x = torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 8
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    col_scale = torch.rand(n, generator=generator) / 100
    out = cpu_avx2_int8.int8_linear(x, cpu_avx2_int8.pack_weight(w), col_scale, block)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert torch.equal(out, three_passes(x, w, col_scale, block))


@AVX2
@torch.inference_mode()
def test_the_one_call_linear_takes_strided_rows_zeros_and_nans():
    """Rows of a wider tensor (q, k and v are views of one projection); a zero row gives zeros, a row
    holding a NaN or an infinity gives NaNs (its scale is NaN), the other rows as they are."""
    wide = torch.randn(4, 200)
    x = wide[:, :128]
    x[1] = 0.0
    x[2, 7] = float("inf")
    w = torch.randint(-127, 128, (32, 128), dtype=torch.int8)
    col_scale = torch.rand(32)
    out = cpu_avx2_int8.int8_linear(x, cpu_avx2_int8.pack_weight(w), col_scale, 64)
    assert torch.equal(out[1], torch.zeros(32)) and out[2].isnan().all()
    assert torch.equal(out[[0, 3]], three_passes(x[[0, 3]].contiguous(), w, col_scale, 64))


@AVX2
def test_the_one_call_linear_refuses_bad_arguments():
    ops = cpu_avx2_int8.load()
    w = cpu_avx2_int8.pack_weight(torch.zeros(16, 64, dtype=torch.int8))
    x, scale, out = torch.zeros(3, 64), torch.ones(16), torch.empty(3, 16)
    with pytest.raises(ValueError, match="x must be a float32 CPU tensor"):
        ops.int8_linear(x.double(), w, scale, 0, out)
    with pytest.raises(ValueError, match="x must be a float32 CPU tensor"):
        ops.int8_linear(torch.zeros(64, 3).t(), w, scale, 0, out)
    with pytest.raises(ValueError, match="hadamard_block must be 0, or 4, 16 or 64 dividing K"):
        ops.int8_linear(x, w, scale, 8, out)
    with pytest.raises(ValueError, match="hadamard_block must be 0, or 4, 16 or 64 dividing K"):
        ops.int8_linear(x, w, scale, 128, out)
    with pytest.raises(ValueError, match=r"col_scale must be a contiguous float32 CPU tensor \[16\]"):
        ops.int8_linear(x, w, torch.ones(32), 0, out)
    with pytest.raises(ValueError, match=r"out must be a contiguous float32 CPU tensor \[3, 16\]"):
        ops.int8_linear(x, w, scale, 0, torch.empty(3, 32))
    with pytest.raises(ValueError, match="packed weight must be"):
        ops.int8_linear(torch.zeros(3, 128), w, scale, 0, out)


def test_a_weight_holding_minus_128_is_refused():
    w = torch.zeros(16, 64, dtype=torch.int8)
    w[4, 9] = -128
    with pytest.raises(ValueError, match=r"weights in \[-127, 127\]; this one holds -128"):
        cpu_avx2_int8.pack_weight(w)
    with pytest.raises(ValueError, match="pack_weight takes an int8"):
        cpu_avx2_int8.pack_weight(torch.zeros(16, 60, dtype=torch.int8))


@AVX2
def test_the_kernel_refuses_bad_arguments():
    ops = cpu_avx2_int8.load()
    w = cpu_avx2_int8.pack_weight(torch.zeros(16, 64, dtype=torch.int8))
    q = torch.zeros(3, 64, dtype=torch.int8)
    acc = torch.empty(3, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous int8"):
        ops.int8_matmul(q.float(), w, acc)
    with pytest.raises(ValueError, match="acc must be a contiguous int32"):
        ops.int8_matmul(q, w, acc.float())
    with pytest.raises(ValueError, match=r"acc must be \[3, 16\]"):
        ops.int8_matmul(q, w, torch.empty(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed weight must be"):
        ops.int8_matmul(torch.zeros(3, 128, dtype=torch.int8), w, acc)
    with pytest.raises(ValueError, match="in_features % 4"):
        ops.int8_matmul(torch.zeros(3, 30, dtype=torch.int8), w, acc)


def test_the_switch_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_avx2_int8.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="WEFT_AVX2_INT8 must be 0 or 1"):
        cpu_avx2_int8.enabled_by_env()
    monkeypatch.setenv(cpu_avx2_int8.ENV_SWITCH, "0")
    assert not cpu_avx2_int8.enabled_by_env()
