"""weft's integer GEMM on AVX-512 VNNI (``kernels.cpu_vnni_int8``) against its twin, an exact
matmul of the same int8 tensors: exact, at every row count its register tiles distinguish (one
to six rows a tile, a last part-filled tile, the chunks of 192 rows a prefill goes through), for
weights of one to many blocks of 16 rows (strips of one to four blocks), on one thread and two."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_vnni_int8

VNNI = pytest.mark.skipif(not cpu_vnni_int8.available(), reason="needs AVX-512 VNNI and weft's VNNI kernel")


def twin(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The integer product, taken in fp64: every partial sum is an integer far below 2**53, so exact
    in any order, and BLAS runs it (torch's int64 matmul is a scalar loop)."""
    return (q.double() @ w.double().t()).to(torch.int32)


def product(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_vnni_int8.int8_matmul(q, cpu_vnni_int8.pack_weight(w), cpu_vnni_int8.row_bias(w))


@VNNI
@torch.inference_mode()
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n, k", [(16, 64), (48, 128), (80, 576), (112, 192), (576, 1536), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 32, 64, 191, 192, 193, 400])
def test_the_kernel_gives_the_integer_product(torch_threads, n, k, rows):
    generator = torch.Generator().manual_seed(rows * 7919 + n + k)
    q = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=generator)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    acc = product(q, w)
    assert acc.dtype == torch.int32 and acc.shape == (rows, n) and acc.is_contiguous()
    assert torch.equal(acc, twin(q, w))


@VNNI
@torch.inference_mode()
def test_extreme_values_sum_exactly():
    """-128 goes in as 0 (its sign bit flipped) and comes back through the row sums: exact."""
    q = torch.full((7, 1536), -128, dtype=torch.int8)
    q[3] = 127
    w = torch.full((32, 1536), -128, dtype=torch.int8)
    w[1] = 127
    acc = product(q, w)
    assert torch.equal(acc, twin(q, w))
    assert acc[0, 0].item() == 128 * 128 * 1536 and acc[0, 1].item() == -128 * 127 * 1536
    assert acc[3, 1].item() == 127 * 127 * 1536


@VNNI
@torch.inference_mode()
def test_a_strided_q_is_made_contiguous():
    q = torch.randint(-128, 128, (8, 256), dtype=torch.int8)[:, :128]
    w = torch.randint(-128, 128, (16, 128), dtype=torch.int8)
    assert torch.equal(product(q, w), twin(q, w))


def test_row_bias_is_minus_128_times_each_rows_sum():
    w = torch.tensor([[1, -2, 3, 127], [-128, -128, 0, 0]], dtype=torch.int8)
    bias = cpu_vnni_int8.row_bias(w)
    assert bias.dtype == torch.int32 and bias.tolist() == [-128 * 129, 128 * 256]
    with pytest.raises(ValueError, match="row_bias takes an int8"):
        cpu_vnni_int8.row_bias(w.float())


@VNNI
def test_the_kernel_refuses_bad_arguments():
    ops = cpu_vnni_int8.load()
    weight = torch.zeros(16, 64, dtype=torch.int8)
    w, bias = cpu_vnni_int8.pack_weight(weight), cpu_vnni_int8.row_bias(weight)
    q = torch.zeros(3, 64, dtype=torch.int8)
    acc = torch.empty(3, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous int8"):
        ops.int8_matmul(q.float(), w, bias, acc)
    with pytest.raises(ValueError, match="bias and acc must be contiguous int32"):
        ops.int8_matmul(q, w, bias, acc.float())
    with pytest.raises(ValueError, match="bias and acc must be contiguous int32"):
        ops.int8_matmul(q, w, bias.long(), acc)
    with pytest.raises(ValueError, match=r"acc must be \[3, 16\]"):
        ops.int8_matmul(q, w, bias, torch.empty(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"bias must be \[16\]"):
        ops.int8_matmul(q, w, bias[:8], acc)
    with pytest.raises(ValueError, match="packed weight must be"):
        ops.int8_matmul(torch.zeros(3, 128, dtype=torch.int8), w, bias, acc)
    with pytest.raises(ValueError, match="in_features % 4"):
        ops.int8_matmul(torch.zeros(3, 30, dtype=torch.int8), w, bias, acc)


def test_the_switch_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_vnni_int8.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="WEFT_VNNI_INT8 must be 0 or 1"):
        cpu_vnni_int8.enabled_by_env()
    monkeypatch.setenv(cpu_vnni_int8.ENV_SWITCH, "0")
    assert not cpu_vnni_int8.enabled_by_env()
