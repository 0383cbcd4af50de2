"""The RMSNorm kernel, plain and fused with the residual add, against its twin."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import rms_norm_ref
from kernels.rms_norm import rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [64, 576])  # 576 (the default model's) is not a power of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_twin(with_residual, hidden, dtype, device, generator, close):
    x = torch.randn(7, hidden, generator=generator).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=generator)).to(dtype)
    residual = torch.randn(7, hidden, generator=generator).to(dtype) if with_residual else None
    args = (1e-5, None if residual is None else residual.to(device))
    out = rms_norm(x.to(device), weight.to(device), *args)
    expected = rms_norm_ref(x, weight, 1e-5, residual)
    if with_residual:
        (out, summed), (expected, expected_sum) = out, expected
        close(summed, expected_sum, dtype, scale=4)  # |x + residual| reaches about 4
    close(out, expected, dtype, scale=8)  # normalized values times weights reach about 8


def test_inputs_are_left_alone(device):
    x, residual = torch.ones(2, 64, device=device), torch.ones(2, 64, device=device)
    rms_norm(x, torch.ones(64, device=device), 1e-5, residual)
    assert torch.equal(x, torch.ones_like(x)) and torch.equal(residual, torch.ones_like(residual))


def test_refuses_a_mismatched_weight(device):
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.ones(2, 64, device=device), torch.ones(32, device=device), 1e-5)
