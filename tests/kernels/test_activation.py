"""The SiLU-and-mul kernel against its twin."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul
from kernels.reference import silu_and_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("intermediate", [96, 1536])  # one partial block; several blocks
def test_matches_twin(intermediate, dtype, device, generator, close):
    x = (2 * torch.randn(5, 2 * intermediate, generator=generator)).to(dtype)
    close(silu_and_mul(x.to(device)), silu_and_mul_ref(x), dtype, scale=16)  # |silu(g) * u| reaches about 16


def test_twin_is_the_mlp_gate(generator):
    x = torch.randn(3, 8, generator=generator)
    torch.testing.assert_close(silu_and_mul_ref(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])


def test_refuses_an_odd_width(device):
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(torch.zeros(2, 7, device=device))
