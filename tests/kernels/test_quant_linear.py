"""The compiled quantized-linear kernels against their torch twins (kernels/reference.py).

The rebuilt weights must equal the twin's exactly (the same fp32 products);
the matmul may differ only by the order of fp32 sums: within 1e-5 of the
largest output for K = 576.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_quant_linear
from kernels.reference import dequantize_packed_ref, quant_linear_ref

SUM_ORDER_TOLERANCE = 1e-5  # relative to the largest |output|


def random_packed(layout: str, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // group, generator=g) * 0.1
    if layout == "int8":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
        return q, scales, None
    q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int16).to(torch.uint8)
    return q, scales, torch.randn(n, k // group, generator=g) * 0.1


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    try:
        cpu_quant_linear.load()
    except cpu_quant_linear.KernelUnavailable as exc:  # the torch twins are then what runs
        pytest.fail(f"the kernel must build on the test machine: {exc}")


LAYOUTS = [("int8", 32), ("int8", 16), ("int4", 32)]


@pytest.mark.parametrize("layout,group", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 64])
def test_quant_linear_matches_the_twin(layout, group, rows):
    n, k = 203, 576  # n not a multiple of the kernel's 4-row tiles
    q, s, m = random_packed(layout, n, k, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    expected = quant_linear_ref(x, q, s, m, group)
    actual = cpu_quant_linear.quant_linear(x, q, s, m, group)
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=SUM_ORDER_TOLERANCE * float(expected.abs().max())
    )


@pytest.mark.parametrize("layout,group", LAYOUTS)
def test_dequantized_rows_equal_the_twin_exactly(layout, group):
    q, s, m = random_packed(layout, 37, 256, group, seed=3)
    rows = cpu_quant_linear.dequantize_rows(q, s, m, group, start=5, count=20, in_features=256)
    assert torch.equal(rows, dequantize_packed_ref(q, s, m, group)[5:25])


def test_int4_nibble_order():
    """Byte j of a group holds element j (low nibble) and element j + 16 (high nibble)."""
    q = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)  # element 0 = 1, element 16 = 2
    ones = torch.ones(1, 1)
    w = dequantize_packed_ref(q, ones, torch.zeros(1, 1), 32)
    assert w[0, 0] == 1 and w[0, 16] == 2 and w.sum() == 3
    x = torch.zeros(1, 32)
    x[0, 16] = 1.0
    assert cpu_quant_linear.quant_linear(x, q, ones, torch.zeros(1, 1), 32).item() == 2.0


def test_strided_rows_of_x_and_out():
    q, s, m = random_packed("int4", 16, 64, 32)
    wide = torch.randn(3, 128)
    x = wide[:, :64]  # rows 128 floats apart
    out = torch.full((3, 40), -7.0)
    cpu_quant_linear.quant_linear(x, q, s, m, 32, out=out[:, 8:24])
    torch.testing.assert_close(out[:, 8:24], quant_linear_ref(x, q, s, m, 32), rtol=1e-5, atol=1e-5)
    assert (out[:, :8] == -7).all() and (out[:, 24:] == -7).all()


def test_bad_arguments_are_refused():
    q, s, m = random_packed("int4", 8, 64, 32)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_quant_linear.quant_linear(torch.randn(2, 64, dtype=torch.bfloat16), q, s, m, 32)
    with pytest.raises(RuntimeError, match="qweight shape"):
        cpu_quant_linear.quant_linear(torch.randn(2, 96), q, s, m, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        cpu_quant_linear.quant_linear(torch.randn(2, 64), q, s, m, 16)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_quant_linear.quant_linear(torch.randn(2, 64), q.view(torch.int8), s, m, 32)
    with pytest.raises(RuntimeError, match="rows out of range"):
        cpu_quant_linear.dequantize_rows(q, s, m, 32, start=4, count=8, in_features=64)
