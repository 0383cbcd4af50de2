"""Kernel tests: on the GPU when there is one, else under Triton's interpreter on CPU.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, that is when
its module is first imported; pytest imports this file before the test
modules beside it, so setting it here is early enough. Nothing outside the
Triton backend imports ``kernels.*`` modules, so no earlier test can have
imported them uninterpreted. An explicit ``TRITON_INTERPRET`` is respected.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import interpreting

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED = interpreting()
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")

# Max abs error allowed against the fp32 twins, per dtype, for values of order 1.
# bf16 gets two units in the last place: besides its own rounding, the
# interpreter converts fp32 to bf16 by truncation where the GPU rounds.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> None:
    """Max abs error within the dtype's bound times ``scale`` (the values' magnitude)."""
    error = (actual.float().cpu() - expected.float().cpu()).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, (
        f"max abs error {error} > {TOLERANCE[dtype] * scale} for {dtype}"
    )


@pytest.fixture(scope="session")
def close():
    return assert_close


@pytest.fixture
def torch_threads(request):
    """Run a test on ``request.param`` torch threads (parametrize it with ``indirect=True``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
