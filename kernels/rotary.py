"""Rotary position embedding, neox style (Llama's), applied in place.

The pairs rotated together are ``(x[i], x[i + D/2])`` of each head. One
program per token rotates all its query and key heads, reading one row of
the cos/sin tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_t,
    token,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_P: tl.constexpr,
):
    heads = tl.arange(0, HEADS_P)
    cols = tl.arange(0, HALF_P)
    mask = (heads < NUM_HEADS)[:, None] & (cols < HEAD_DIM // 2)[None, :]
    first = x_ptr + token * stride_t + heads[:, None] * HEAD_DIM + cols[None, :]  # [heads, D/2]
    second = first + HEAD_DIM // 2
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(second, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_kt,
    stride_cos,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_P)
    col_ok = cols < HEAD_DIM // 2
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=col_ok, other=0.0).to(tl.float32)[
        None, :
    ]  # [1, D/2]
    sin = tl.load(sin_ptr + pos * stride_cos + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(query_ptr, stride_qt, token, cos, sin, NUM_HEADS, HEADS_P, HEAD_DIM, HALF_P)
    _rotate_heads(key_ptr, stride_kt, token, cos, sin, NUM_KV_HEADS, KV_HEADS_P, HEAD_DIM, HALF_P)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> None:
    """Rotate query ``[T, H * D]`` and key ``[T, KVH * D]`` in place by ``positions [T]``.

    ``cos`` and ``sin`` are ``[max_positions, D]`` (their halves repeat, as
    ``RotaryEmbedding`` builds them; the kernel reads the first half).
    Rows may be strided (slices of a fused QKV output); each row's heads
    must be contiguous.
    """
    _check(positions, query, key, cos, sin, head_dim)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    num_heads, num_kv_heads = query.shape[1] // head_dim, key.shape[1] // head_dim
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos,
        sin,
        query.stride(0),
        key.stride(0),
        cos.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P=triton.next_power_of_2(num_heads),
        KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HALF_P=triton.next_power_of_2(head_dim // 2),
    )


def _check(positions, query, key, cos, sin, head_dim) -> None:
    num_tokens = positions.shape[0]
    if query.dim() != 2 or key.dim() != 2 or query.shape[0] != num_tokens or key.shape[0] != num_tokens:
        raise ValueError(
            f"expected query [T, H * D] and key [T, KVH * D] for T = {num_tokens}, "
            f"got {tuple(query.shape)} and {tuple(key.shape)}."
        )
    if head_dim % 2 or query.shape[1] % head_dim or key.shape[1] % head_dim:
        raise ValueError(f"head_dim ({head_dim}) must be even and divide the widths of query and key.")
    if query.stride(1) != 1 or key.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("query, key, cos and sin must be contiguous within a row.")
    if cos.shape != sin.shape or cos.shape[1] < head_dim // 2 or cos.stride() != sin.stride():
        raise ValueError(
            f"cos and sin must be matching [positions, D] tables, got {tuple(cos.shape)} and {tuple(sin.shape)}."
        )
