"""The MLP's gate: ``[T, 2I]`` (gate, up) -> ``silu(gate) * up`` ``[T, I]``, one kernel on the Triton backend."""
from __future__ import annotations

import torch
from torch import nn

from services.worker.forward_context import current_backend


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if current_backend() == "triton":
        from kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return nn.functional.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate, up) -> ``gelu_tanh(gate) * up`` ``[T, I]``: Gemma's GeGLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.gelu(gate, approximate="tanh") * up
