"""RMSNorm, computed in fp32 whatever the activation dtype (as Llama was trained).

Given the residual stream too, it adds the sublayer's output to it first and
returns both the normalized sum and the new residual: one fused kernel on
the Triton backend, and one compiled kernel on CPU (``kernels.cpu_fused``)
which, like vLLM's ``fused_add_rms_norm``, writes both results over its
inputs: callers use what is returned, never the tensors they passed.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_fused
from services.worker.forward_context import current_backend
from services.worker.layers.kernel_device import cpu_fused_for_model


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        # Chosen once: the compiled CPU kernels exist for these dtypes, and built here (or not).
        self._cpu_fused = cpu_fused_for_model(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> [T, H]; with ``residual`` [T, H]: (norm(x + residual), x + residual)."""
        if current_backend() == "triton":
            from kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if self._cpu_fused and x.device.type == "cpu" and x.dim() == 2:  # per-head norms (QK-norm) are 3-D
            if residual is None:
                return cpu_fused.rms_norm(x, self.weight, self.eps)
            cpu_fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """The same operation order as Hugging Face's, so fp32 results match bit for bit."""
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (checkpoints store the offset from 1), and
    multiplies in fp32 before casting back, where Llama casts first (Hugging Face's order).

    An fp32 model on CPU runs it as the compiled RMSNorm with ``1 + weight`` as its weight: in fp32
    there is no cast between, so Llama's order is Gemma's (a Gemma 3 decode step has six norms a
    layer, which as torch ops took 15% of it)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self._cpu_fused = dtype == torch.float32 and cpu_fused_for_model(dtype)
        self._one_plus: tuple[int, torch.Tensor] | None = None  # (weight's version, 1 + weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H], normalized over the last dimension."""
        if (
            self._cpu_fused
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and current_backend() != "triton"
        ):
            rows = x.reshape(-1, x.shape[-1])
            return cpu_fused.rms_norm(rows, self.one_plus_weight(), self.eps).view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)

    def one_plus_weight(self) -> torch.Tensor:
        """``1 + weight``, the compiled kernel's weight: made after the weights load, and again
        if they are written."""
        version = self.weight._version
        if self._one_plus is None or self._one_plus[0] != version:
            self._one_plus = (version, 1.0 + self.weight.detach())
        return self._one_plus[1]
