"""The MLP's gate: ``[T, 2I]`` (gate, up) -> ``silu(gate) * up`` ``[T, I]``, one kernel on the Triton
backend and one compiled kernel on CPU (``kernels.cpu_fused``, built or not once per process)."""
from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_fused
from services.worker.forward_context import current_backend


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if current_backend() == "triton":
        from kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    if gate_up.device.type == "cpu" and gate_up.dtype in cpu_fused.DTYPES and cpu_fused.available():
        return cpu_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return nn.functional.silu(gate) * up
