"""RMSNorm, optionally fused with the residual add that precedes it.

Llama adds each sublayer's output to the residual stream and normalizes the
sum right away; doing both in one pass reads the row once instead of three
times. Arithmetic is fp32; the normalized row is rounded to the activation
dtype before the weight multiplies it, in Hugging Face's order, so fp16 and
bf16 results round as the torch path's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,  # [T, N]
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    stride_xt,
    stride_rt,
    stride_ot,
    stride_rot,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rt + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype).to(tl.float32)  # the residual stream is kept in the activation dtype
        tl.store(residual_out_ptr + row * stride_rot + cols, x.to(dtype), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + cols, (normed * w).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x [..., N]`` -> ``norm(x) * weight`` over the last dimension (per-head norms, QK-norm, are
    ``[T, heads, D]``); with ``residual`` shaped like ``x``, ``(norm(x + residual) * weight,
    x + residual)``. Inputs are not modified."""
    _check(x, weight, residual)
    if x.dim() != 2:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])  # a view where the rows are evenly strided, else a copy
        res = None if residual is None else residual.reshape(-1, shape[-1])
        result = rms_norm(rows, weight, eps, res)
        if residual is None:
            return result.view(shape)
        return result[0].view(shape), result[1].view(shape)
    num_rows, n = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            out,
            residual_out,
            x,
            x if residual is None else residual,
            weight,
            eps,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            residual_out.stride(0),
            N=n,
            BLOCK_N=triton.next_power_of_2(n),
            HAS_RESIDUAL=residual is not None,
        )
    return out if residual is None else (out, residual_out)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"expected x [..., N] and weight [N], got {tuple(x.shape)} and {tuple(weight.shape)}."
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}."
        )
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("x, residual and weight must be contiguous in their last dimension.")
