"""The int8 dense copy's two integer GEMMs: ``torch._int_mm`` and oneDNN's int8 matmul on a
prepacked weight (the AMX tiles where the CPU has them). Both give the same numbers, whatever
CPU runs the test: oneDNN falls back to the dot products the CPU has."""

from __future__ import annotations

import pytest
import torch

from services.worker.layers import int8_linear
from services.worker.layers.int8_linear import Int8Weight, default_int8_gemm


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(7)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (960, 576), (49152, 576)])
def test_the_onednn_gemm_gives_the_int_mm_gemms_numbers(generator, dtype, shape):
    n, k = shape
    weight = torch.randn(n, k, generator=generator) * 0.05
    weight[:, 11] *= 30.0  # an outlier column, as the default model's activations have
    by_int_mm, by_onednn = Int8Weight(weight, gemm="int_mm"), Int8Weight(weight, gemm="onednn")
    assert by_onednn.nbytes == by_int_mm.nbytes == n * k + 4 * n
    bias = torch.randn(n, generator=generator).to(dtype)
    for rows in (1, 7, 32, 301):
        x = (torch.randn(rows, k, generator=generator) * 2).to(dtype)
        q, scale = by_int_mm._quantize(x, by_int_mm.hadamard_block)
        integers = by_int_mm.integer_product(q)
        floats = by_onednn.integer_product(q)
        assert integers.dtype == torch.int32 and floats.dtype == torch.float32
        assert torch.equal(floats, integers.float())
        for b in (None, bias):
            got = by_onednn.linear(x, b)
            assert got.dtype == dtype and torch.equal(got, by_int_mm.linear(x, b))
        # The MLP's path: an x already rounded.
        assert torch.equal(
            by_onednn.linear_rounded(q, scale, None, dtype), by_int_mm.linear_rounded(q, scale, None, dtype)
        )


def test_the_gemm_is_chosen_by_the_cpus_flags(monkeypatch):
    assert default_int8_gemm({"avx512_vnni", "avx512_bf16"}) == "int_mm"
    assert default_int8_gemm({"avx2"}) == "int_mm"
    assert default_int8_gemm({"amx_tile", "amx_int8", "amx_bf16"}) == "onednn"
    monkeypatch.setattr(int8_linear, "_onednn_ops_present", lambda: False)
    assert default_int8_gemm({"amx_tile", "amx_int8"}) == "int_mm"
    with pytest.raises(ValueError, match="needs torch's oneDNN int8 linear ops"):
        Int8Weight(torch.ones(4, 64), gemm="onednn")


def test_an_unknown_gemm_is_refused():
    with pytest.raises(ValueError, match="gemm must be one of int_mm, onednn, got 'mkl'"):
        Int8Weight(torch.ones(4, 64), gemm="mkl")
