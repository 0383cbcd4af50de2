"""weft's integer GEMM on AVX2 (``kernels.cpu_avx2_int8``) against its twin, an int64 matmul of the
same int8 tensors: exact, at every row count its register tiles distinguish (one to four rows a
tile, strips of up to four blocks for one row and two for two, the chunks of 192 rows a prefill goes through), for
weights of one to many blocks of 16 rows, on one thread and two; and the weight range it needs."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_avx2_int8

AVX2 = pytest.mark.skipif(not cpu_avx2_int8.available(), reason="needs AVX2 and weft's AVX2 kernel")


def exact(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (q.long() @ w.long().t()).to(torch.int32)


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
