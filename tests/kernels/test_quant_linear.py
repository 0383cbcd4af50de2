"""The compiled quantized-linear kernels against their torch twins (kernels/reference.py).

The rebuilt weights must equal the twin's exactly (the same fp32 products);
the matmul may differ only by the order of fp32 sums: within 1e-5 of the
largest output for K = 576. With int8 or int16 activations
(``quant_linear_i8``, ``quant_linear_i16``) the rounding of x is the twin's
bit for bit, so the same holds against ``quant_linear_i8_ref``; against the
fp32 twin the error stays within what rounding x allows. Every build the CPU runs (AVX-512 VNNI, AVX2,
generic) is run by name.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_quant_linear
from kernels.reference import (
    SUPER_BLOCK,
    dequantize_packed_ref,
    fifth_bits_per_group,
    packed_values,
    quant_linear_i8_ref,
    quant_linear_ref,
    quantize_rows_i8_ref,
    super_scales_ref,
)

SUM_ORDER_TOLERANCE = 1e-5  # relative to the largest |output|


def random_bytes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int16).to(torch.uint8)


def random_packed(layout: str, n: int, k: int, group: int, seed: int = 0):
    """(qweight, scales, mins, qhigh) of ``layout``: int8, int4, int5 or int6 (groups of 16, no
    mins), "-implied" without mins (Q4_0's -8 * scale, Q5_0's -16 * scale)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // group, generator=g) * 0.1
    if layout == "int8":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
        return q, scales, None, None
    q = random_bytes((n, k // 2), g)
    if layout == "int6":
        return q, scales, None, random_bytes((n, k // 4), g)
    qhigh = random_bytes((n, k // 8), g) if layout.startswith("int5") else None
    if layout.endswith("-implied"):
        return q, scales, None, qhigh
    return q, scales, torch.randn(n, k // group, generator=g) * 0.1, qhigh


ISAS = cpu_quant_linear.supported_isas()


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    try:
        for isa in ISAS:
            cpu_quant_linear.load(isa)
    except cpu_quant_linear.KernelUnavailable as exc:  # the torch twins are then what runs
        pytest.fail(f"the kernel must build on the test machine: {exc}")


LAYOUTS = [
    ("int8", 32),
    ("int8", 16),
    ("int4", 32),
    ("int4-implied", 32),
    ("int5", 32),
    ("int5-implied", 32),
    ("int6", 16),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout,group", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 64])
def test_quant_linear_matches_the_twin(isa, layout, group, rows):
    n, k = 203, 640 if layout == "int6" else 576  # n not a multiple of the kernel's 4-row tiles
    q, s, m, h = random_packed(layout, n, k, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    expected = quant_linear_ref(x, q, s, m, group, h)
    actual = cpu_quant_linear.quant_linear(x, q, s, m, group, isa=isa, qhigh=h)
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=SUM_ORDER_TOLERANCE * float(expected.abs().max())
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout,group", LAYOUTS)
def test_dequantized_rows_equal_the_twin_exactly(isa, layout, group):
    q, s, m, h = random_packed(layout, 37, 256, group, seed=3)
    rows = cpu_quant_linear.dequantize_rows(
        q, s, m, group, start=5, count=20, in_features=256, isa=isa, qhigh=h
    )
    assert torch.equal(rows, dequantize_packed_ref(q, s, m, group, h)[5:25])


def test_int4_nibble_order():
    """Byte j of a group holds element j (low nibble) and element j + 16 (high nibble)."""
    q = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)  # element 0 = 1, element 16 = 2
    ones = torch.ones(1, 1)
    w = dequantize_packed_ref(q, ones, torch.zeros(1, 1), 32)
    assert w[0, 0] == 1 and w[0, 16] == 2 and w.sum() == 3
    x = torch.zeros(1, 32)
    x[0, 16] = 1.0
    assert cpu_quant_linear.quant_linear(x, q, ones, torch.zeros(1, 1), 32).item() == 2.0


@pytest.mark.parametrize("isa", ISAS)
def test_int5_fifth_bit_order(isa):
    """Bit j of a group's little-endian qhigh word adds 16 to element j, in every op."""
    q = torch.zeros(1, 16, dtype=torch.uint8)
    q[0, 0] = 0x21  # element 0 = 1, element 16 = 2
    qhigh = torch.tensor([[0x01, 0x00, 0x01, 0x80]], dtype=torch.uint8)  # bits 0, 16 and 31
    ones, zeros = torch.ones(1, 1), torch.zeros(1, 1)
    w = dequantize_packed_ref(q, ones, zeros, 32, qhigh)
    assert w[0, 0] == 17 and w[0, 16] == 18 and w[0, 31] == 16 and w.sum() == 51
    rows = cpu_quant_linear.dequantize_rows(q, ones, zeros, 32, 0, 1, 32, isa=isa, qhigh=qhigh)
    assert torch.equal(rows, w)
    for element, value in ((0, 17.0), (16, 18.0), (31, 16.0), (5, 0.0)):
        x = torch.zeros(1, 32)
        x[0, element] = 1.0
        assert cpu_quant_linear.quant_linear(x, q, ones, zeros, 32, isa=isa, qhigh=qhigh).item() == value
        for kernel, _ in INT_KERNELS.values():
            assert kernel(x, q, ones, zeros, 32, isa=isa, qhigh=qhigh).item() == value, (element, kernel)


@pytest.mark.parametrize("isa", ISAS)
def test_q5_k_bit_plane_order(isa):
    """With records (Q5_K) qhigh is bit planes: bit b of byte i of a super-block's 32 adds 16 to
    element 16 (b % 2) + i % 16 of group 2 (b // 2) + i // 16, in every op that takes records and
    in the per-group words it becomes with fp32 scales. Weight row n sets bit n % 8 of byte n // 8."""
    n = 256
    q = torch.zeros(n, 128, dtype=torch.uint8)
    qhigh = torch.zeros(n, 32, dtype=torch.uint8)
    qhigh[torch.arange(n), torch.arange(n) // 8] = (1 << (torch.arange(n) % 8)).to(torch.uint8)
    byte, bit = torch.arange(n) // 8, torch.arange(n) % 8
    element = 32 * (2 * (bit // 2) + byte // 16) + 16 * (bit % 2) + byte % 16
    halves = torch.tensor([1.0, 0.0]).half().view(torch.uint8)  # d 1, dmin 0
    sc_m = torch.tensor([1] * 8 + [0] * 8, dtype=torch.uint8)  # every sc 1, every m 0
    records = torch.cat((halves, sc_m)).expand(n, 1, 20).contiguous()
    expected = torch.zeros(n, 256)
    expected[torch.arange(n), element] = 16.0
    assert torch.equal(dequantize_packed_ref(q, records, None, 32, qhigh), expected)
    scales, mins, words = per_group("Q5_K", records, qhigh)
    assert torch.equal(dequantize_packed_ref(q, scales, mins, 32, words), expected)
    x = torch.eye(256)  # row m picks element m (16 up to the rounding of x's scale)
    for kernel, _ in INT_KERNELS.values():
        for out in (
            kernel(x, q, records, None, 32, isa=isa, qhigh=qhigh),
            kernel(x, q, scales, mins, 32, isa=isa, qhigh=words),
        ):
            torch.testing.assert_close(
                out[element, torch.arange(n)], torch.full((n,), 16.0), rtol=1e-6, atol=0
            )
            assert out.count_nonzero() == n, kernel


@pytest.mark.parametrize("isa", ISAS)
def test_int6_bit_order(isa):
    """int6 holds Q6_K's bits per 128 weights: byte l of qweight element l's low four bits (low
    nibble) and l + 64's (high), byte 32 + l elements 32 + l and 96 + l; byte l of qhigh the two high
    bits of elements l, 32 + l, 64 + l and 96 + l; a weight is (q - 32) times its group's scale."""
    q = torch.full((1, 64), 0x88, dtype=torch.uint8)  # every low four bits 8
    q[0, 40] = 0x5A  # element 40: 10, element 104: 5
    qhigh = torch.zeros(1, 32, dtype=torch.uint8)
    qhigh[0, 1] = 0b11_10_01_00  # high bits of element 1: 0, 33: 1, 65: 2, 97: 3
    scales = torch.arange(1.0, 9.0)[None]  # groups of 16
    values = torch.full((128,), 8.0)
    values[40], values[104], values[33], values[65], values[97] = 10, 5, 8 + 16, 8 + 32, 8 + 48
    expected = ((values - 32) * scales.repeat_interleave(16))[None]
    w = dequantize_packed_ref(q, scales, None, 16, qhigh)
    assert torch.equal(w, expected)
    rows = cpu_quant_linear.dequantize_rows(q, scales, None, 16, 0, 1, 128, isa=isa, qhigh=qhigh)
    assert torch.equal(rows, w)
    for element in (0, 1, 33, 40, 65, 97, 104, 127):
        x = torch.zeros(1, 128)
        x[0, element] = 1.0
        value = float(w[0, element])
        assert cpu_quant_linear.quant_linear(x, q, scales, None, 16, isa=isa, qhigh=qhigh).item() == value
        for kernel, _ in INT_KERNELS.values():
            assert kernel(x, q, scales, None, 16, isa=isa, qhigh=qhigh).item() == value, (element, kernel)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("records", [False, True])
def test_int6_gives_the_bits_of_the_same_weights_as_int8(isa, records):
    """The int6 layout's kernels unpack q - 32 and run the int8 layout's arithmetic: every op gives
    the bits the int8 layout (Q6_K's before) gives for the same weights, per-16 scales or (but
    quant_linear_i8's super-block path) records."""
    if records:
        q, s, _, h = random_super("Q6_K", 203, 768, seed=9)
    else:
        q, s, _, h = random_packed("int6", 203, 640, 16, seed=9)
    as_int8 = packed_values(q, 16, h).flatten(1)  # [N, K] int8, q - 32
    k = as_int8.shape[1]
    # With records quant_linear_i8 takes the super-block path for int6 (x rounded per 256), not the
    # int8 layout's per-group one.
    kernels = [INT_KERNELS["int16"]] if records else INT_KERNELS.values()
    for rows in (1, 2, 3, 4, 5, 9, 33):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        for kernel, _ in kernels:
            assert torch.equal(
                kernel(x, q, s, None, 16, isa=isa, qhigh=h), kernel(x, as_int8, s, None, 16, isa=isa)
            )
    if records:
        s = super_scales_ref(s, False, 16)[0]
    int6 = cpu_quant_linear.quant_linear(x, q, s, None, 16, isa=isa, qhigh=h)
    assert torch.equal(int6, cpu_quant_linear.quant_linear(x, as_int8, s, None, 16, isa=isa))
    rows = cpu_quant_linear.dequantize_rows(q, s, None, 16, 3, 190, k, isa=isa, qhigh=h)
    assert torch.equal(rows, cpu_quant_linear.dequantize_rows(as_int8, s, None, 16, 3, 190, k, isa=isa))


def test_strided_rows_of_x_and_out():
    q, s, m, _ = random_packed("int4", 16, 64, 32)
    wide = torch.randn(3, 128)
    x = wide[:, :64]  # rows 128 floats apart
    out = torch.full((3, 40), -7.0)
    cpu_quant_linear.quant_linear(x, q, s, m, 32, out=out[:, 8:24])
    torch.testing.assert_close(out[:, 8:24], quant_linear_ref(x, q, s, m, 32), rtol=1e-5, atol=1e-5)
    assert (out[:, :8] == -7).all() and (out[:, 24:] == -7).all()


def test_bad_arguments_are_refused():
    q, s, m, _ = random_packed("int4", 8, 64, 32)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_quant_linear.quant_linear(torch.randn(2, 64, dtype=torch.bfloat16), q, s, m, 32)
    with pytest.raises(RuntimeError, match="qweight shape"):
        cpu_quant_linear.quant_linear(torch.randn(2, 96), q, s, m, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        cpu_quant_linear.quant_linear(torch.randn(2, 64), q, s, m, 48)
    q6, s6 = random_bytes((8, 64), torch.Generator()), torch.ones(8, 8)  # K 128 in groups of 16: int6
    with pytest.raises(RuntimeError, match="int6 layout, which needs its qhigh"):
        cpu_quant_linear.quant_linear(torch.randn(2, 128), q6, s6, None, 16)
    with pytest.raises(RuntimeError, match="qhigh"):  # int6's high bits: [N, K / 4], not int5's K / 8
        cpu_quant_linear.quant_linear_i8(
            torch.randn(2, 128), q6, s6, None, 16, qhigh=torch.zeros(8, 16, dtype=torch.uint8)
        )
    with pytest.raises(RuntimeError, match="K a multiple of 128"):
        cpu_quant_linear.quant_linear(torch.randn(2, 64), q, torch.ones(8, 4), None, 16)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_quant_linear.quant_linear(torch.randn(2, 64), q.view(torch.int8), s, m, 32)
    with pytest.raises(RuntimeError, match="rows out of range"):
        cpu_quant_linear.dequantize_rows(q, s, m, 32, start=4, count=8, in_features=64)
    with pytest.raises(RuntimeError, match="qhigh"):  # the fifth bits: [N, K / 8] uint8
        cpu_quant_linear.quant_linear_i8(
            torch.randn(2, 64), q, s, m, 32, qhigh=torch.zeros(8, 4, dtype=torch.uint8)
        )


def test_every_build_the_cpu_runs_is_the_one_named():
    assert ISAS[-1] == "generic" and len(set(ISAS)) == len(ISAS)
    for isa in ISAS:
        assert cpu_quant_linear.load(isa).isa() == isa


def test_weft_quant_isa_forces_a_build(monkeypatch):
    monkeypatch.setenv(cpu_quant_linear.ENV_ISA, "generic")
    assert cpu_quant_linear.default_isa() == "generic"
    monkeypatch.setenv(cpu_quant_linear.ENV_ISA, "")
    assert cpu_quant_linear.default_isa() == ISAS[0]
    monkeypatch.setenv(cpu_quant_linear.ENV_ISA, "sse9")
    with pytest.raises(ValueError, match="WEFT_QUANT_ISA='sse9' is not one of avx512vnni, avx2, generic"):
        cpu_quant_linear.default_isa()


def test_a_build_that_fails_gives_way_to_the_next(monkeypatch):
    real_build = cpu_quant_linear.build

    def no_avx512(name, source, what, isa=None, defines=()):
        if isa[0] == "avx512vnni":
            raise cpu_quant_linear.KernelUnavailable("this compiler has no -mavx512vnni")
        return real_build(name, source, what, isa=isa, defines=defines)

    monkeypatch.setattr(cpu_quant_linear, "build", no_avx512)
    monkeypatch.delenv(cpu_quant_linear.ENV_ISA, raising=False)
    monkeypatch.setattr(cpu_quant_linear, "supported_isas", lambda: ["avx512vnni", "avx2", "generic"])
    assert cpu_quant_linear.load.__wrapped__().isa() == "avx2"  # past the cache
    monkeypatch.setenv(cpu_quant_linear.ENV_ISA, "avx512vnni")  # forced: no fallback
    with pytest.raises(cpu_quant_linear.KernelUnavailable, match="no -mavx512vnni"):
        cpu_quant_linear.load.__wrapped__()


# (layout, group, K): int4 K with an even and an odd number of 32-blocks (the kernel pairs
# blocks), with mins stored and implied; int8 by 16 with K a multiple of 16 but not 32 (a half block at the end).
I8_SHAPES = [
    ("int8", 32, 576),
    ("int8", 16, 592),
    ("int4", 32, 576),
    ("int4", 32, 608),
    ("int4-implied", 32, 608),
    ("int5", 32, 576),
    ("int5", 32, 608),
    ("int5-implied", 32, 608),
    ("int6", 16, 640),  # int6 comes in 128s: an odd number of them
    ("int6", 16, 384),
]


# The integer-activation kernels and the integer type each rounds x to.
INT_KERNELS = {
    "int8": (cpu_quant_linear.quant_linear_i8, torch.int8),
    "int16": (cpu_quant_linear.quant_linear_i16, torch.int16),
}


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout,group,k", I8_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 31])
def test_integer_activation_kernels_match_their_twin(bits, isa, layout, group, k, rows):
    kernel, dtype = INT_KERNELS[bits]
    q, s, m, h = random_packed(layout, 203, k, group, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    expected = quant_linear_i8_ref(x, q, s, m, group, dtype, qhigh=h)
    actual = kernel(x, q, s, m, group, isa=isa, qhigh=h)
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=SUM_ORDER_TOLERANCE * float(expected.abs().max())
    )


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout,group,k", I8_SHAPES)
@pytest.mark.parametrize("n", [3, 4, 6, 203])  # under one block of four weight rows, one, and tails
def test_batch1_row_blocks_match_the_row_by_row_loop_and_the_twin(bits, isa, layout, group, k, n):
    """One row of x in blocks of four weight rows (int8: two 2 x 1 tiles that prefetch the next
    rows a share per step) gives the bits of the row-by-row loop."""
    kernel, dtype = INT_KERNELS[bits]
    q, s, m, h = random_packed(layout, n, k, group, seed=n)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    expected = quant_linear_i8_ref(x, q, s, m, group, dtype, qhigh=h)
    try:
        cpu_quant_linear.set_single_row_blocks(False, isa)
        row_by_row = kernel(x, q, s, m, group, isa=isa, qhigh=h)
    finally:
        cpu_quant_linear.set_single_row_blocks(True, isa)
    blocked = kernel(x, q, s, m, group, isa=isa, qhigh=h)
    assert torch.equal(blocked, row_by_row)  # each row's sums in the same order
    torch.testing.assert_close(
        blocked, expected, rtol=0, atol=SUM_ORDER_TOLERANCE * float(expected.abs().max())
    )


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("layout,group,k", I8_SHAPES)
def test_integer_activations_err_only_by_the_rounding_of_x(bits, layout, group, k):
    """|y - y_fp32| <= sum_j |w_j| * d_j / 2, d_j the step of x's group of j (plus fp32 sums)."""
    kernel, dtype = INT_KERNELS[bits]
    q, s, m, h = random_packed(layout, 64, k, group, seed=5)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(6)) * 3
    w = dequantize_packed_ref(q, s, m, group, h)
    _, steps = quantize_rows_i8_ref(x, group, dtype)
    bound = (steps.repeat_interleave(group, dim=1) / 2) @ w.abs().T
    expected = quant_linear_ref(x, q, s, m, group, h)
    error = (kernel(x, q, s, m, group, qhigh=h) - expected).abs()
    assert (error <= bound * 1.001 + SUM_ORDER_TOLERANCE * float(expected.abs().max())).all()
    assert error.max() > 0  # x really is rounded


def test_activations_round_half_to_even_with_a_scale_of_amax_over_127():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([127.0, 2.5, 3.5, -2.5])  # amax 127: the step is exactly 1
    q = torch.eye(32, dtype=torch.int8)[:4]  # row i picks element i
    out = cpu_quant_linear.quant_linear_i8(x, q, torch.ones(4, 1), None, 32)
    assert out.flatten().tolist() == [127.0, 2.0, 4.0, -2.0]
    xq, d = quantize_rows_i8_ref(x, 32)
    assert xq[0, 0, :4].tolist() == [127, 2, 4, -2] and d.item() == 1.0


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("isa", ISAS)
def test_int8_weights_of_minus_128_and_extreme_activations(bits, isa):
    """-128 weights against activations of both signs: no saturation in the integer dots."""
    q = torch.full((3, 64), -128, dtype=torch.int8)
    q[1, ::2] = 127
    x = torch.tensor([[1.0, -1.0] * 32, [-5.0] * 64])
    s = torch.full((3, 2), 0.5)
    expected = quant_linear_ref(x, q, s, None, 32)
    torch.testing.assert_close(INT_KERNELS[bits][0](x, q, s, None, 32, isa=isa), expected)


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("isa", ISAS)
def test_a_nan_in_x_reaches_only_its_row(bits, isa):
    kernel, dtype = INT_KERNELS[bits]
    q, s, m, _ = random_packed("int4", 16, 64, 32)
    x = torch.randn(3, 64)
    x[1, 40] = float("nan")
    out = kernel(x, q, s, m, 32, isa=isa)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
    assert quant_linear_i8_ref(x, q, s, m, 32, dtype)[1].isnan().all()


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("isa", ISAS)
def test_integer_activation_kernels_take_strided_rows_of_x_and_out(bits, isa):
    kernel, dtype = INT_KERNELS[bits]
    q, s, m, _ = random_packed("int4", 16, 64, 32)
    x = torch.randn(5, 128)[:, 64:]  # rows 128 floats apart
    out = torch.full((5, 40), -7.0)
    kernel(x, q, s, m, 32, out=out[:, 8:24], isa=isa)
    expected = quant_linear_i8_ref(x, q, s, m, 32, dtype)
    torch.testing.assert_close(out[:, 8:24], expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    assert (out[:, :8] == -7).all() and (out[:, 24:] == -7).all()


@pytest.mark.parametrize("bits", INT_KERNELS)
def test_integer_activation_kernels_refuse_bad_arguments(bits):
    kernel, name = INT_KERNELS[bits][0], f"quant_linear_i{bits[3:]}"
    q, s, m, _ = random_packed("int8", 8, 128, 64)
    with pytest.raises(RuntimeError, match=f"{name}: group_size must be 16 or 32"):
        kernel(torch.randn(2, 128), q, s, None, 64)
    q, s, m, _ = random_packed("int4", 8, 64, 32)
    with pytest.raises(RuntimeError, match=f"{name}: x must be fp32"):
        kernel(torch.randn(2, 64, dtype=torch.bfloat16), q, s, m, 32)
    with pytest.raises(RuntimeError, match="qweight shape"):
        kernel(torch.randn(2, 96), q, s, m, 32)
    with pytest.raises(RuntimeError, match=f"{name}: out must be fp32"):
        kernel(torch.randn(2, 64), q, s, m, 32, out=torch.empty(3, 8))


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout,group,k", I8_SHAPES)
def test_a_rows_result_has_the_same_bits_whatever_rows_share_the_call(bits, isa, layout, group, k):
    """Batch invariance: each (row, weight row) pair is summed in one order at every row count,
    across the 4-row tiles, the batch-1 path and the blocks of rows a long call is cut into."""
    q, s, m, h = random_packed(layout, 203, k, group)
    x = torch.randn(700, k, generator=torch.Generator().manual_seed(5))  # several blocks of rows
    kernel, _ = INT_KERNELS[bits]
    whole = kernel(x, q, s, m, group, isa=isa, qhigh=h)
    for start, rows in ((0, 1), (3, 1), (5, 2), (9, 3), (0, 8), (17, 31), (100, 64), (0, 300), (650, 50)):
        part = kernel(x[start : start + rows].contiguous(), q, s, m, group, isa=isa, qhigh=h)
        assert torch.equal(part, whole[start : start + rows]), (start, rows)


@pytest.mark.skipif(
    not {"avx512vnni", "avx2"} <= set(ISAS), reason="needs a CPU that runs both the AVX-512 and AVX2 builds"
)
@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("layout,group,k", I8_SHAPES)
@pytest.mark.parametrize("half", [False, True])
def test_the_avx512_build_gives_the_bits_of_the_avx2_build(bits, layout, group, k, half):
    """The AVX-512 tiles (two weight rows a 512-bit vector) do per lane what the AVX2 tiles do, so
    every tile shape, the batch-1 path and the tails give the AVX2 build's bits."""
    q, s, m, h = random_packed(layout, 203, k, group, seed=7)
    if half:
        s, m = s.half(), None if m is None else m.half()
    kernel, _ = INT_KERNELS[bits]
    for rows in (1, 2, 3, 4, 5, 9, 33):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        wide = kernel(x, q, s, m, group, isa="avx512vnni", qhigh=h)
        assert torch.equal(wide, kernel(x, q, s, m, group, isa="avx2", qhigh=h)), rows


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout,group,k", I8_SHAPES)
def test_fp16_scales_give_the_bits_of_their_fp32_values(bits, isa, layout, group, k):
    """The 32-element GGUF formats keep their blocks' fp16 scales and mins: converted exactly,
    they give the same outputs as the same values in fp32."""
    q, s, m, h = random_packed(layout, 203, k, group)
    s16, m16 = s.half(), None if m is None else m.half()
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(6))
    kernel, _ = INT_KERNELS[bits]
    expected = kernel(x, q, s16.float(), None if m16 is None else m16.float(), group, isa=isa, qhigh=h)
    assert torch.equal(kernel(x, q, s16, m16, group, isa=isa, qhigh=h), expected)


def test_fp32_activation_kernels_refuse_fp16_scales():
    q, s, m, _ = random_packed("int4", 8, 64, 32)
    with pytest.raises(RuntimeError, match="fp32 scales expected"):
        cpu_quant_linear.quant_linear(torch.randn(2, 64), q, s.half(), m.half(), 32)


# The int4-style layouts without stored mins and their implied factor: Q4_0's -8, Q5_0's -16.
IMPLIED = {"int4": -8, "int5": -16}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", IMPLIED)
@pytest.mark.parametrize("k", [576, 608, 256])  # an even and an odd number of 32-blocks; one tail of 8
@pytest.mark.parametrize("half", [False, True])
def test_implied_mins_give_the_bits_of_stored_ones(isa, layout, k, half):
    """Q4_0 and Q5_0 store no mins (None): each op takes -8 * scale (Q5_0: -16 * scale), the value a
    stored min would hold, so every op gives the bits it gives with the mins stored."""
    q, s, _, h = random_packed(f"{layout}-implied", 203, k, 32, seed=11)
    s = s.half() if half else s
    stored = s * IMPLIED[layout]  # exact in fp16 and fp32
    for rows in (1, 2, 3, 4, 5, 33):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        for kernel, _ in INT_KERNELS.values():
            implied = kernel(x, q, s, None, 32, isa=isa, qhigh=h)
            assert torch.equal(implied, kernel(x, q, s, stored, 32, isa=isa, qhigh=h)), rows
        s32 = s.float()
        implied = cpu_quant_linear.quant_linear(x, q, s32, None, 32, isa=isa, qhigh=h)
        explicit = cpu_quant_linear.quant_linear(x, q, s32, s32 * IMPLIED[layout], 32, isa=isa, qhigh=h)
        assert torch.equal(implied, explicit), rows
    s32 = s.float()
    rows = cpu_quant_linear.dequantize_rows(q, s32, None, 32, 3, 190, k, isa=isa, qhigh=h)
    explicit = cpu_quant_linear.dequantize_rows(
        q, s32, s32 * IMPLIED[layout], 32, 3, 190, k, isa=isa, qhigh=h
    )
    assert torch.equal(rows, explicit)


@pytest.mark.parametrize("bits", INT_KERNELS)
@pytest.mark.parametrize("layout", IMPLIED)
def test_implied_mins_match_the_twin(bits, layout):
    kernel, dtype = INT_KERNELS[bits]
    q, s, _, h = random_packed(f"{layout}-implied", 67, 576, 32, seed=12)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4))
    expected = quant_linear_i8_ref(x, q, s, None, 32, dtype, qhigh=h)
    assert torch.equal(expected, quant_linear_i8_ref(x, q, s, s * IMPLIED[layout], 32, dtype, qhigh=h))
    torch.testing.assert_close(
        kernel(x, q, s, None, 32, qhigh=h),
        expected,
        rtol=0,
        atol=SUM_ORDER_TOLERANCE * float(expected.abs().max()),
    )


def random_super(fmt: str, n: int, k: int, seed: int = 0):
    """A K format's weight (Q4_K: int4, Q5_K: int5, Q6_K: int6) with random records per
    super-block: (qweight, records, group, qhigh; Q5_K's as bit planes, its records' layout)."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // SUPER_BLOCK
    halves = (torch.rand(n, blocks, 2, generator=g) * 0.01 + 0.001).half().view(torch.uint8)  # d, dmin
    if fmt in ("Q4_K", "Q5_K"):
        q = random_bytes((n, k // 2), g)
        sc_m = torch.randint(0, 64, (n, blocks, 16), generator=g, dtype=torch.int16).to(torch.uint8)  # 6-bit
        qhigh = random_bytes((n, k // 8), g) if fmt == "Q5_K" else None
        return q, torch.cat((halves, sc_m), dim=-1), 32, qhigh
    q, qhigh = random_bytes((n, k // 2), g), random_bytes((n, k // 4), g)
    sc = (
        torch.randint(-128, 128, (n, blocks, 16), generator=g, dtype=torch.int16)
        .to(torch.int8)
        .view(torch.uint8)
    )
    return q, torch.cat((halves[..., :2], sc), dim=-1), 16, qhigh


def per_group(fmt: str, records: torch.Tensor, qhigh: torch.Tensor | None):
    """The same weights with fp32 scales and mins per group: (scales, mins, qhigh), Q5_K's fifth bits
    as per-group words (the layout that goes with them)."""
    scales, mins = super_scales_ref(records, fmt != "Q6_K", 16 if fmt == "Q6_K" else 32)
    return scales, mins, fifth_bits_per_group(qhigh) if fmt == "Q5_K" else qhigh


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 768])
def test_super_block_scales_give_the_bits_of_their_fp32_products(isa, fmt, k):
    """The K formats keep per super-block fp16 d (and dmin) and 8-bit sc (and m); where x is rounded
    per group (quant_linear_i16; quant_linear_i8 rounds it per 256 against records, the super-block
    path) the kernels form d * sc and -(dmin * m) in fp32, exactly, so every tile and row count
    gives the bits of the fp32 scales and mins per group the repacker stored before."""
    kernel, dtype = INT_KERNELS["int16"]
    q, records, group, h = random_super(fmt, 203, k, seed=k)
    scales, mins, words = per_group(fmt, records, h)
    for rows in (1, 2, 3, 4, 5, 9, 33):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        compact = kernel(x, q, records, None, group, isa=isa, qhigh=h)
        assert torch.equal(compact, kernel(x, q, scales, mins, group, isa=isa, qhigh=words)), rows
    expected = quant_linear_i8_ref(x, q, scales, mins, group, dtype, qhigh=words)
    assert torch.equal(expected, quant_linear_i8_ref(x, q, records, None, group, dtype, qhigh=h))
    torch.testing.assert_close(
        compact, expected, rtol=0, atol=SUM_ORDER_TOLERANCE * float(expected.abs().max())
    )
    # The fp32 activations read the records (and Q5_K's planes) too: the same weights and bits, the
    # streaming rows (up to 4) and the dequantized tiles.
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        fp32 = cpu_quant_linear.quant_linear(x, q, records, None, group, isa=isa, qhigh=h)
        assert torch.equal(
            fp32, cpu_quant_linear.quant_linear(x, q, scales, mins, group, isa=isa, qhigh=words)
        )
    dense = cpu_quant_linear.dequantize_rows(q, records, None, group, 3, 190, k, isa=isa, qhigh=h)
    assert torch.equal(dense, dequantize_packed_ref(q, scales, mins, group, words)[3:193])


def test_super_block_scales_are_checked():
    q, records, group, _ = random_super("Q4_K", 8, 512)
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match="super-block scales"):
        cpu_quant_linear.quant_linear_i8(x, q, records[..., :18].contiguous(), None, group)


# The super-block path: quant_linear_i8 against Q4_K, Q5_K and Q6_K records rounds x per 256.


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 512, 768, 2048])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 31])
def test_super_block_path_matches_its_twin(isa, fmt, k, rows):
    """x rounded per 256, a super-block's eight groups summed in integers: the twin's arithmetic up to
    the order of the fp32 sums over super-blocks, with an odd and an even number of them."""
    q, records, group, h = random_super(fmt, 203, k, seed=k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = quant_linear_i8_ref(x, q, records, None, group, qhigh=h)
    actual = cpu_quant_linear.quant_linear_i8(x, q, records, None, group, isa=isa, qhigh=h)
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=SUM_ORDER_TOLERANCE * float(expected.abs().max())
    )


@pytest.mark.skipif(
    not {"avx512vnni", "avx2"} <= set(ISAS), reason="needs a CPU that runs both the AVX-512 and AVX2 builds"
)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 768, 2048])
def test_the_avx512_super_block_tiles_give_the_bits_of_the_avx2_build(fmt, k):
    """The super-block tiles with two weight rows a 512-bit vector do per lane what the 256-bit
    tiles do: every tile shape (the batch-1 2 x 1, 4 x 4, 4 x 2, 4 x 1 and the one-row tails over
    203 weight rows) gives the AVX2 build's bits."""
    q, records, group, h = random_super(fmt, 203, k, seed=k + 1)
    for rows in (1, 2, 3, 4, 5, 9, 33):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        wide = cpu_quant_linear.quant_linear_i8(x, q, records, None, group, isa="avx512vnni", qhigh=h)
        narrow = cpu_quant_linear.quant_linear_i8(x, q, records, None, group, isa="avx2", qhigh=h)
        assert torch.equal(wide, narrow), (rows, (wide - narrow).abs().max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_fp32_scales_of_k_formats_keep_the_per_group_path(isa, fmt):
    """The fp32-scale fallback (K past the records' reach, a tensor-parallel slice off super-blocks)
    takes x rounded per 32 as before: the per-group twin, not the super-block one."""
    q, records, group, h = random_super(fmt, 67, 768, seed=4)
    scales, mins, words = per_group(fmt, records, h)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(8))
    rounded_per_group = quant_linear_i8_ref(x, q, scales, mins, group, qhigh=words)
    actual = cpu_quant_linear.quant_linear_i8(x, q, scales, mins, group, isa=isa, qhigh=words)
    tolerance = SUM_ORDER_TOLERANCE * float(rounded_per_group.abs().max())
    torch.testing.assert_close(actual, rounded_per_group, rtol=0, atol=tolerance)
    per_super = quant_linear_i8_ref(x, q, records, None, group, qhigh=h)
    assert (per_super - rounded_per_group).abs().max() > 100 * tolerance  # the two roundings do differ
    # and only the rounding: without it (fp32 x) both layouts are the same weights
    torch.testing.assert_close(
        quant_linear_ref(x, q, records, None, group, h),
        quant_linear_ref(x, q, scales, mins, group, words),
        rtol=0,
        atol=tolerance,
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 768])
def test_super_block_path_is_batch_invariant(isa, fmt, k):
    """A row's output has the same bits alone, among 3, 7, 31 or 63 other rows (every tile shape:
    the batch-1 2 x 1 tiles, 2 x 4, 4 x 2, 4 x 1, the lone-row tails), and row by row."""
    q, records, group, h = random_super(fmt, 203, k, seed=k)  # 203 rows: tails past the 4-row blocks
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(k))

    def run(rows: torch.Tensor) -> torch.Tensor:
        return cpu_quant_linear.quant_linear_i8(rows.contiguous(), q, records, None, group, isa=isa, qhigh=h)

    whole = run(x)
    for row in (0, 2, 3, 30, 63):
        alone = run(x[row : row + 1])
        assert torch.equal(alone, whole[row : row + 1]), row
        for size in (4, 8, 32):
            start = min(row, 64 - size)
            assert torch.equal(run(x[start : start + size])[row - start], alone[0]), (row, size)
    try:
        cpu_quant_linear.set_single_row_blocks(False, isa)
        assert torch.equal(run(x), whole)
        assert torch.equal(run(x[5:6]), whole[5:6])
    finally:
        cpu_quant_linear.set_single_row_blocks(True, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_super_block_path_rounds_x_per_256(isa):
    """One scale per 256 elements of x: a value 1000 times the rest of its super-block rounds the rest
    to zero there, while the next super-block keeps its own scale."""
    q, records, group, _ = random_super("Q4_K", 8, 512, seed=6)
    x = torch.ones(1, 512)
    x[0, 0] = 1000.0  # the step of elements 0-255 is 1000 / 127: the ones round to 0
    expected = quant_linear_ref(
        torch.cat((torch.zeros(1, 1) + 1000.0, torch.zeros(1, 255), torch.ones(1, 256)), dim=1),
        q,
        *super_scales_ref(records, True, group),
        group,
    )
    actual = cpu_quant_linear.quant_linear_i8(x, q, records, None, group, isa=isa)
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=SUM_ORDER_TOLERANCE * float(expected.abs().max())
    )


@pytest.mark.parametrize("isa", ISAS)
def test_super_block_path_extremes_do_not_overflow(isa):
    """Q5_K's largest weights (31) and 6-bit scales and mins (63) against x at +-127 of its step:
    the int16 pairs, the int32 sums of a super-block and the min dot stay exact."""
    n, k = 4, 512
    q = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)
    h = torch.full((n, k // 8), 0xFF, dtype=torch.uint8)  # every weight 31
    halves = torch.full((n, k // 256, 2), 0.5).half().view(torch.uint8)  # d, dmin
    records = torch.cat((halves, torch.full((n, k // 256, 16), 63, dtype=torch.uint8)), dim=-1)
    x = torch.full((2, k), 3.0)
    x[1, 1::2] = -3.0  # every element at +-127 of its step of 3 / 127
    expected = quant_linear_ref(x, q, *super_scales_ref(records, True, 32), 32, h)
    actual = cpu_quant_linear.quant_linear_i8(x, q, records, None, 32, isa=isa, qhigh=h)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize("isa", ISAS)
def test_a_nan_in_x_reaches_only_its_row_in_the_super_block_path(isa):
    q, records, group, h = random_super("Q5_K", 16, 512, seed=2)
    x = torch.randn(3, 512)
    x[1, 300] = float("inf")
    out = cpu_quant_linear.quant_linear_i8(x, q, records, None, group, isa=isa, qhigh=h)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
    assert quant_linear_i8_ref(x, q, records, None, group, qhigh=h)[1].isnan().all()


@pytest.mark.parametrize("isa", ISAS)
def test_q6k_super_block_path_extremes_do_not_overflow(isa):
    """Q6_K's most negative weights (q 0, less 32) and scales (-128) against x at 127 of its step:
    the int16 pairs less their bias, the int32 sums of a super-block stay exact."""
    n, k = 4, 512
    q = torch.zeros(n, k // 2, dtype=torch.uint8)
    h = torch.zeros(n, k // 4, dtype=torch.uint8)  # every q 0: weights -32 sc d
    d = torch.full((n, k // 256, 1), 0.5).half().view(torch.uint8)
    sc = torch.full((n, k // 256, 16), -128, dtype=torch.int8).view(torch.uint8)
    records = torch.cat((d, sc), dim=-1)
    x = torch.full((2, k), 3.0)
    x[1, 1::2] = -3.0
    expected = quant_linear_ref(x, q, super_scales_ref(records, False, 16)[0], None, 16, h)
    actual = cpu_quant_linear.quant_linear_i8(x, q, records, None, 16, isa=isa, qhigh=h)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-3)
