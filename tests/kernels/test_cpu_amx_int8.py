"""weft's integer GEMM on AMX int8 tiles (``kernels.cpu_amx_int8``) against its twin, an exact
matmul of the same int8 tensors: exact, at every row count its blocking distinguishes (one row,
a part-filled group of 16, one and two groups a pass, the chunks of 256 rows a prefill goes
through), for weights of one to many blocks of 16 rows, on one thread and on two."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_amx_int8

AMX = pytest.mark.skipif(not cpu_amx_int8.available(), reason="needs AMX int8 tiles and weft's AMX kernel")


def twin(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The integer product, taken in fp64: every partial sum is an integer far below 2**53, so exact
    in any order, and BLAS runs it (torch's int64 matmul is a scalar loop)."""
    return (q.double() @ w.double().t()).to(torch.int32)


@AMX
@torch.inference_mode()
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n, k", [(16, 64), (48, 128), (80, 576), (576, 1536), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 47, 64, 256, 300, 513])
def test_the_kernel_gives_the_integer_product(torch_threads, n, k, rows):
    generator = torch.Generator().manual_seed(rows * 7919 + n + k)
    q = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=generator)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    acc = cpu_amx_int8.int8_matmul(q, cpu_amx_int8.pack_weight(w))
    assert acc.dtype == torch.int32 and acc.shape == (rows, n) and acc.is_contiguous()
    assert torch.equal(acc, twin(q, w))


@AMX
@torch.inference_mode()
def test_extreme_values_sum_exactly():
    """-128 * -128 over 1,536 columns: 25.2 million, far inside int32, and exact."""
    q = torch.full((5, 1536), -128, dtype=torch.int8)
    w = torch.full((32, 1536), -128, dtype=torch.int8)
    w[1] = 127
    acc = cpu_amx_int8.int8_matmul(q, cpu_amx_int8.pack_weight(w))
    assert torch.equal(acc, twin(q, w))
    assert acc[0, 0].item() == 128 * 128 * 1536 and acc[0, 1].item() == -128 * 127 * 1536


@AMX
@torch.inference_mode()
def test_a_strided_q_is_made_contiguous():
    q = torch.randint(-128, 128, (8, 256), dtype=torch.int8)[:, :128]
    w = torch.randint(-128, 128, (16, 128), dtype=torch.int8)
    assert torch.equal(cpu_amx_int8.int8_matmul(q, cpu_amx_int8.pack_weight(w)), twin(q, w))


def test_pack_weight_lays_out_words_of_four_per_block():
    w = torch.arange(32 * 64, dtype=torch.int32).remainder(251).sub(125).to(torch.int8).reshape(32, 64)
    packed = cpu_amx_int8.pack_weight(w)
    assert packed.shape == (2, 16, 16, 4)
    # block b, word p, row r of the block: columns 4p .. 4p + 3 of row 16 b + r
    assert torch.equal(packed[1, 3, 5], w[21, 12:16])


@pytest.mark.parametrize(
    "weight",
    [torch.zeros(16, 64), torch.zeros(17, 64, dtype=torch.int8), torch.zeros(16, 65, dtype=torch.int8)],
    ids=["float", "rows-off-16", "columns-off-64"],
)
def test_pack_weight_refuses_what_the_tiles_cannot_take(weight):
    with pytest.raises(ValueError, match="pack_weight takes an int8"):
        cpu_amx_int8.pack_weight(weight)


@AMX
def test_the_kernel_refuses_bad_arguments():
    ops = cpu_amx_int8.load()
    w = cpu_amx_int8.pack_weight(torch.zeros(16, 64, dtype=torch.int8))
    q = torch.zeros(3, 64, dtype=torch.int8)
    acc = torch.empty(16, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous int8"):
        ops.int8_matmul(q.float(), w, acc)
    with pytest.raises(ValueError, match="acc must be a contiguous int32"):
        ops.int8_matmul(q, w, acc.float())
    with pytest.raises(ValueError, match=r"acc must be \[16, 16\]"):
        ops.int8_matmul(q, w, torch.empty(3, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed weight must be"):
        ops.int8_matmul(torch.zeros(3, 128, dtype=torch.int8), w, acc)
    with pytest.raises(ValueError, match="in_features % 64"):
        ops.int8_matmul(torch.zeros(3, 32, dtype=torch.int8), w, acc)


def test_the_switch_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_amx_int8.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="WEFT_AMX_INT8 must be 0 or 1"):
        cpu_amx_int8.enabled_by_env()
    monkeypatch.setenv(cpu_amx_int8.ENV_SWITCH, "0")
    assert not cpu_amx_int8.enabled_by_env()
