"""SiLU-and-mul, the gate of Llama's MLP: ``[T, 2I]`` (gate, up) -> ``silu(gate) * up``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_xt, stride_ot, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + N + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` (gate columns first) -> ``[T, I]``."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"expected x [T, 2I] contiguous in its last dimension, got {tuple(x.shape)}.")
    num_rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(n, _BLOCK))](
            out, x, x.stride(0), out.stride(0), N=n, BLOCK=_BLOCK
        )
    return out
