"""The MLP's gate: ``[T, 2I]`` (gate, up) -> ``silu(gate) * up`` ``[T, I]``, one kernel on the Triton
backend, and one compiled kernel on CPU through ``SiluAndMul``; Gemma's ``gelu_tanh(gate) * up``
likewise through ``GeluTanhAndMul`` (torch ops on the Triton backend)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels import cpu_fused
from services.worker.forward_context import current_backend
from services.worker.layers.kernel_device import cpu_fused_for_model


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


class _GateAndMul(nn.Module):
    """A gate-and-mul as a layer: on CPU, the compiled kernel (``kernels.cpu_fused``) when it was
    built, chosen once at construction; else the torch (or Triton) function."""

    def __init__(
        self,
        compiled: Callable[[torch.Tensor], torch.Tensor],
        fallback: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self._cpu_fused = cpu_fused_for_model()
        self._compiled, self._fallback = compiled, fallback

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if (
            self._cpu_fused
            and gate_up.device.type == "cpu"
            and gate_up.dtype in cpu_fused.DTYPES
            and current_backend() != "triton"
        ):
            return self._compiled(gate_up)
        return self._fallback(gate_up)


class SiluAndMul(_GateAndMul):
    """``silu_and_mul`` as a layer (``_GateAndMul``)."""

    def __init__(self) -> None:
        super().__init__(cpu_fused.silu_and_mul, silu_and_mul)


class GeluTanhAndMul(_GateAndMul):
    """``gelu_tanh_and_mul`` as a layer (``_GateAndMul``): the compiled kernel is one pass where the
    torch ops take three, the GeLU's tanh form through the kernels' exponential (7.5 us for a
    2,048-wide row against the torch ops' 32, Zen 1)."""

    def __init__(self) -> None:
        super().__init__(cpu_fused.gelu_tanh_and_mul, gelu_tanh_and_mul)
