"""Write the step's new keys and values into the paged cache, by slot mapping.

Token ``t`` goes to slot ``slot_mapping[t] = block * block_size + offset``;
a negative slot skips the token (the padding rows of a CUDA-graph batch).
One program per token copies all its KV heads at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import check_kv_write_args


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,  # [T, KVH, D]
    kv_ptr,  # [2, KVH, num_blocks, block_size, D]
    slot_mapping_ptr,  # [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_ch,
    stride_cb,
    stride_cs,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # powers of two covering the two
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dest = (
        heads[:, None].to(tl.int64) * stride_ch
        + (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
    )
    elem = kv_ptr.dtype.element_ty
    tl.store(kv_ptr + dest + dims[None, :], k.to(elem), mask=mask)
    tl.store(kv_ptr + stride_kv + dest + dims[None, :], v.to(elem), mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key and value ``[T, KVH, D]`` in ``kv_cache`` at ``slot_mapping [T]`` (in place)."""
    check_kv_write_args(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[3],
    )
