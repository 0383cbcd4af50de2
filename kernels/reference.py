"""Torch twins of the Triton kernels: the same signatures, written for clarity.

Each twin states what its kernel computes, in plain torch on any device;
the kernel tests compare the two. Arithmetic is fp32 whatever the input
dtype, as in the kernels, with one cast to the output dtype at the end.
The argument checks live here too, so a kernel wrapper and its twin refuse
the same inputs with the same messages.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_paged_attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    check_query_and_cache(query, kv_cache)
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}.")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_table.shape[0] < seq_lens.shape[0]:
        raise ValueError(
            f"query_start_loc needs R + 1 entries and block_table R rows for R = {seq_lens.shape[0]} "
            f"sequences, got {query_start_loc.shape[0]} and {block_table.shape[0]}."
        )


def check_query_and_cache(
    query: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None
) -> None:
    """Shapes, dtypes and layout every paged-attention kernel needs of its query and cache: a cache
    of the query's float dtype, or (the CPU kernels') an int8 one with its ``kv_scales``."""
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"expected query [T, H, D] and kv_cache [2, KVH, num_blocks, block_size, D], "
            f"got {tuple(query.shape)} and {tuple(kv_cache.shape)}."
        )
    _, num_heads, head_dim = query.shape
    _, num_kv_heads, _, _, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads}) "
            f"and head sizes must agree ({head_dim} vs {cache_dim})."
        )
    if kv_cache.dtype == torch.int8:
        check_kv_scales(kv_cache, kv_scales)
        if query.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"query must be float32, bfloat16 or float16, got {query.dtype}.")
    else:
        if kv_scales is not None:
            raise ValueError(f"kv_scales go with an int8 kv_cache only, not a {kv_cache.dtype} one.")
        if query.dtype not in _FLOAT_DTYPES or kv_cache.dtype != query.dtype:
            raise ValueError(
                f"query and kv_cache must share a float dtype, got {query.dtype} and {kv_cache.dtype}."
            )
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache must be contiguous in the head dimension.")


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Twin of ``kernels.paged_attention.paged_attention`` (tiling arguments are ignored), and with
    ``window > 0`` of the CPU decode kernel's sliding window: a query sees its last ``window`` keys."""
    check_paged_attention_args(query, kv_cache, query_start_loc, seq_lens, block_table)
    out = torch.empty_like(query) if out is None else out
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    group = query.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        kv = (
            kv_cache[:, :, blocks].reshape(2, num_kv_heads, -1, head_dim)[:, :, :seq_len].float()
        )  # [2, KVH, S, D]
        k = kv[0].repeat_interleave(group, dim=0)  # [H, S, D]
        v = kv[1].repeat_interleave(group, dim=0)
        q = query[start:end].float().transpose(0, 1)  # [H, n, D]
        scores = q @ k.transpose(1, 2) * scale  # [H, n, S]
        query_pos = seq_len - (end - start) + torch.arange(end - start, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        hidden = key_pos > query_pos[:, None]  # [n, S]
        if window > 0:
            hidden |= key_pos <= query_pos[:, None] - window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[start:end] = (probs @ v).transpose(0, 1).to(out.dtype)
    return out


def check_kv_write_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or kv_cache.shape[1] != num_kv_heads or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"key and value [T, KVH, D] must match each other and kv_cache [2, KVH, blocks, block_size, D]: "
            f"got {tuple(key.shape)}, {tuple(value.shape)} and {tuple(kv_cache.shape)}."
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be [T] int32 or int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}."
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in the head dimension.")


def write_kv_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Twin of ``kernels.kv_cache.write_kv_cache``: token ``t`` goes to slot ``slot_mapping[t]``; -1 skips it."""
    check_kv_write_args(key, value, kv_cache, slot_mapping)
    two, kvh, num_blocks, block_size, d = kv_cache.shape
    rows = kv_cache.view(two, kvh, num_blocks * block_size, d)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows[0, :, slots] = key[keep].transpose(0, 1).to(kv_cache.dtype)
    rows[1, :, slots] = value[keep].transpose(0, 1).to(kv_cache.dtype)


def check_kv_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """An int8 ``kv_cache [2, KVH, num_blocks, block_size, D]``'s scales: float32
    ``[2, KVH, num_blocks, block_size]``, contiguous, on the cache's device."""
    want = list(kv_cache.shape[:4])
    if kv_scales is None:
        raise ValueError(f"an int8 kv_cache needs kv_scales, float32 {want}.")
    if kv_scales.dtype != torch.float32 or list(kv_scales.shape) != want:
        raise ValueError(f"kv_scales must be float32 {want}, got {kv_scales.dtype} {list(kv_scales.shape)}.")
    if not kv_scales.is_contiguous() or kv_scales.device != kv_cache.device:
        raise ValueError("kv_scales must be contiguous and on the kv_cache's device.")


def check_kv_int8_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    cpu: bool = False,
) -> None:
    """``write_kv_int8``'s arguments, from shapes, dtypes and strides alone (no tensor op): key and
    value ``[T, KVH, D]`` of one float dtype, contiguous in D (views of a fused QKV output will
    do), an int8 cache with its scales, ``slot_mapping`` int64 ``[T]``; ``cpu``: CPU tensors."""
    if key.dim() != 3 or value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(
            f"key and value must be [T, KVH, D] of one dtype, got {tuple(key.shape)} {key.dtype} and "
            f"{tuple(value.shape)} {value.dtype}."
        )
    if key.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"key and value must be float32, bfloat16 or float16, got {key.dtype}.")
    if kv_cache.dtype != torch.int8 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be int8 [2, KVH, num_blocks, block_size, D], got {kv_cache.dtype} "
            f"{tuple(kv_cache.shape)}."
        )
    if kv_cache.shape[1] != key.shape[1] or kv_cache.shape[4] != key.shape[2]:
        raise ValueError(
            f"key and value [T, KVH, D] must match kv_cache's KV heads and head size: got "
            f"{tuple(key.shape)} and {tuple(kv_cache.shape)}."
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous.")
    check_kv_scales(kv_cache, kv_scales)
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}."
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1 or not slot_mapping.is_contiguous():
        raise ValueError("key and value must be contiguous in the head dimension, slot_mapping contiguous.")
    if cpu and any(t.device.type != "cpu" for t in (key, value, kv_cache, kv_scales, slot_mapping)):
        raise ValueError("write_kv_int8 takes CPU tensors only.")


def quantize_kv_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the int8 cache writes (``kernels.cpu_attention.write_kv_int8``), bit for bit: each
    row of ``x [..., D]`` to int8 ``q [..., D]`` and a float32 ``scale [...]``, ``x ~ q * scale``.

    In fp32, one correctly rounded operation a step: ``amax = max |x|``, ``scale = amax / 127``,
    ``inv = min(127 / amax, FLT_MAX)`` (so a zero row's ``127 / 0`` is finite),
    ``q = clamp(round_half_even(x * inv), -127, 127)``. A zero row gets scale 0 and zeros; a row
    holding a NaN or an infinity a NaN scale and zeros."""
    x = x.float()
    amax = x.abs().amax(-1)  # NaN where a row holds one, inf where it holds an infinity
    inv = (torch.full_like(amax, 127.0) / amax).clamp(max=torch.finfo(torch.float32).max)
    q = torch.round(x * inv[..., None]).clamp(-127, 127)
    finite = amax.isfinite()
    q = torch.where(finite[..., None], q, 0).to(torch.int8)
    return q, torch.where(finite, amax / 127, torch.nan)


def round_query_int8_ref(query: torch.Tensor, scale: float) -> torch.Tensor:
    """The query as the int8-cache decode's int8 dot products see it (bf16 queries on a CPU with
    AVX512_VNNI, ``kernels.cpu_attention.int8_dot_queries``): times ``scale`` in fp32, each head's row
    rounded to int8 as ``quantize_kv_rows_ref`` rounds a cache row, then back to fp32 and divided by
    ``scale`` again, so that ``paged_attention_ref`` over it computes the kernel's scores."""
    q, row_scale = quantize_kv_rows_ref(query.float() * scale)
    return q.float() * row_scale[..., None] / scale


def write_kv_int8_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Twin of ``kernels.cpu_attention.write_kv_int8``: token ``t``'s key and value rows, rounded by
    ``quantize_kv_rows_ref``, go to slot ``slot_mapping[t]`` of the int8 cache and their scales to
    the same slot of ``kv_scales``; a negative slot skips the token."""
    check_kv_int8_write_args(key, value, kv_cache, kv_scales, slot_mapping)
    _, kvh, num_blocks, block_size, d = kv_cache.shape
    if bool((slot_mapping >= num_blocks * block_size).any()):
        raise ValueError(
            f"slot_mapping entries must be below num_blocks x block_size = {num_blocks * block_size}."
        )
    rows = kv_cache.view(2, kvh, num_blocks * block_size, d)
    row_scales = kv_scales.view(2, kvh, num_blocks * block_size)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for i, x in enumerate((key, value)):
        q, scale = quantize_kv_rows_ref(x[keep])  # [n, KVH, D], [n, KVH]
        rows[i, :, slots] = q.transpose(0, 1)
        row_scales[i, :, slots] = scale.transpose(0, 1)


def dequantize_kv_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows ``q [..., D]`` times their ``scales [...]`` in fp32, then cast to ``dtype``: an int8
    cache's keys or values as the kernels read them (any gathered slice of a cache with the same
    slice of its scales)."""
    if q.dtype != torch.int8 or scales.dtype != torch.float32 or q.shape[:-1] != scales.shape:
        raise ValueError(
            f"expected int8 rows [..., D] and float32 scales [...], got {q.dtype} {tuple(q.shape)} and "
            f"{scales.dtype} {tuple(scales.shape)}."
        )
    return (q.float() * scales[..., None]).to(dtype)


def dequantize_kv_cache(kv_cache: torch.Tensor, kv_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int8 ``kv_cache`` as a ``dtype`` one of the same shape, for ``paged_attention_ref``
    (pass ``torch.float32`` to compare with the kernels, whose arithmetic is fp32)."""
    check_kv_scales(kv_cache, kv_scales)
    return dequantize_kv_rows(kv_cache, kv_scales, dtype)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``kernels.norms.rms_norm``: ``norm(x) * weight``, or with a residual
    ``(norm(x + residual) * weight, x + residual)``."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


def qk_norm_rotary_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``kernels.cpu_fused.qk_norm_rotary``: new tensors, each head's row normalized, then
    rotated."""
    t = query.shape[0]
    q = cast(torch.Tensor, rms_norm_ref(query.reshape(-1, head_dim), q_weight, eps)).reshape(t, -1)
    k = cast(torch.Tensor, rms_norm_ref(key.reshape(-1, head_dim), k_weight, eps)).reshape(t, -1)
    rotary_embedding_ref(positions, q, k, cos, sin, head_dim)
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> None:
    """Twin of ``kernels.rotary.rotary_embedding``: rotate query ``[T, H * D]`` and key
    ``[T, KVH * D]`` in place, neox style (the two halves of each head form the pairs).

    ``cos`` and ``sin`` are ``[max_positions, D]`` tables whose halves repeat, as
    ``RotaryEmbedding`` builds them.
    """
    half = head_dim // 2
    c = cos[positions.long(), :half].float()[:, None, :]  # [T, 1, D/2]
    s = sin[positions.long(), :half].float()[:, None, :]
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_dim)  # [T, heads, D]
        x1, x2 = heads[..., :half].float(), heads[..., half:].float()
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        heads.copy_(rotated.to(x.dtype))


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.cpu_fused.argmax_rows``: each row's index of its maximum, the first on ties,
    the first NaN where a row holds one."""
    return x.max(dim=-1).indices


def norm_add_norm_ref(
    residual: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``kernels.cpu_fused.norm_add_norm``: (the residual plus ``norm(x) * w_post``, the norm
    of that times ``w_pre``), new tensors."""
    summed = residual + cast(torch.Tensor, rms_norm_ref(x, w_post, eps))
    return summed, cast(torch.Tensor, rms_norm_ref(summed, w_pre, eps))


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.cpu_fused.gelu_tanh_and_mul``: ``[T, 2I]`` (gate, up) -> ``gelu_tanh(gate) * up``."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.activation.silu_and_mul``: ``[T, 2I]`` (gate, up) -> ``silu(gate) * up`` ``[T, I]``."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def dequantize_packed_ref(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    qhigh: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of ``kernels.cpu_quant_linear.dequantize_rows`` over all rows: the fp32 weight
    ``[N, K]`` of a packed one (layouts in ``kernels/csrc/cpu_quant_linear.cpp``).

    int8 (``qweight [N, K]`` int8): ``w = q * s``; int4 (``qweight [N, K / 2]`` uint8):
    ``w = q * s + m``, where each group of 32 takes 16 bytes, element ``j`` in byte ``j``'s low
    nibble, ``j + 16`` in its high, and ``m`` is ``mins``' or, with ``mins`` None, ``-8 s``
    (Q4_0's); int5 (int4's plus ``qhigh [N, K / 8]`` uint8): per group a little-endian uint32 whose
    bit ``j`` adds 16 to element ``j``, implied mins ``-16 s`` (Q5_0's); int6 (``qweight [N, K / 2]``
    and ``qhigh [N, K / 4]`` uint8, groups of 16, no mins; the low and high bits of 6-bit ``q``
    per 128 weights as a Q6_K block holds them, see ``packed_values``): ``w = (q - 32) * s``.
    ``scales`` per group, or the K formats' records per super-block (``super_scales_ref``; int5 with
    records, Q5_K's, holds its fifth bits as bit planes, see ``packed_values``).
    """
    values = packed_values(qweight, group_size, qhigh, planes=scales.dim() == 3).float()  # [N, groups, G]
    scales, mins = group_scales(qweight, scales, mins, group_size, qhigh)
    if not has_mins(qweight, group_size):
        return (values * scales[..., None]).flatten(1)
    return torch.addcmul(mins[..., None], values, scales[..., None]).flatten(1)


def packed_values(
    qweight: torch.Tensor, group_size: int, qhigh: torch.Tensor | None = None, planes: bool = False
) -> torch.Tensor:
    """The integers ``q`` of a packed weight per group, ``[N, groups, group_size]``: int8's as they
    are, int4's nibbles (element ``j`` low, ``j + 16`` high), int5's with their fifth bits added,
    int6's less 32 (int8, the value the scale multiplies).

    int5 holds its fifth bits per group (a little-endian uint32 whose bit ``j`` is element ``j``'s)
    or, with ``planes`` (Q5_K with its records, which its super-block path reads), as bit planes: 32
    bytes a super-block, in the order the kernel unpacks a pair of groups (2p, 2p + 1) into two
    vectors, ``lo`` (elements 0-15 of 2p, then 0-15 of 2p + 1) and ``hi`` (16-31 of each): byte ``i``
    holds the fifth bit of ``lo``'s byte ``i`` in bit ``2p`` and of ``hi``'s in bit ``2p + 1``, so each
    vector's bits are one shift and one mask of the 32 bytes.

    int6 holds Q6_K's ``ql`` and ``qh`` as they are: per 128 weights 64 bytes of ``qweight``, byte
    ``l`` holding element ``l`` (low nibble) and ``l + 64`` (high), byte ``32 + l`` elements ``32 + l``
    and ``96 + l``, and 32 bytes of ``qhigh``, byte ``l`` holding the two high bits of elements ``l``,
    ``32 + l``, ``64 + l`` and ``96 + l`` in its bits 0-1, 2-3, 4-5 and 6-7."""
    if not is_int4(qweight):
        return qweight.unflatten(1, (-1, group_size))
    if is_int6(qweight, group_size):
        low = qweight.unflatten(1, (-1, 2, 32))  # [N, chunks of 128, 2, 32]
        nibbles = torch.cat((low & 0x0F, low >> 4), dim=2)  # [N, chunks, 4 quarters, 32]
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8)[:, None]  # [4, 1]: a quarter's bits
        high = (qhigh.unflatten(1, (-1, 1, 32)) >> shifts) & 3  # [N, chunks, 4, 32]
        q = (nibbles | (high << 4)).to(torch.int8) - 32
        return q.flatten(1).unflatten(1, (-1, group_size))  # [N, groups of 16, 16]
    grouped = qweight.unflatten(1, (-1, 16))  # [N, groups of 32, 16] bytes
    values = torch.cat((grouped & 0x0F, grouped >> 4), dim=-1)  # [N, groups, 32]
    if qhigh is None:
        return values
    return values | (_fifth_bits(qhigh, planes) << 4)


def _fifth_bits(qhigh: torch.Tensor, planes: bool) -> torch.Tensor:
    """int5's fifth bits, ``[N, groups, 32]`` 0 or 1 in element order, from either layout."""
    bits = torch.arange(8, dtype=torch.uint8)
    if not planes:
        words = qhigh.unflatten(1, (-1, 4))  # [N, groups, 4]: byte i holds elements 8i..8i + 7
        return ((words[..., None] >> bits) & 1).flatten(2)
    n = qhigh.shape[0]
    # [N, B, bit 2p + h, byte 16 s + t] -> [N, B, pair p, h, s, t] -> group 2p + s, element 16 h + t
    fifth = (qhigh.unflatten(1, (-1, 1, 32)) >> bits[:, None]) & 1
    return fifth.unflatten(3, (2, 16)).unflatten(2, (4, 2)).permute(0, 1, 2, 4, 3, 5).reshape(n, -1, 32)


def fifth_bits_per_group(planes: torch.Tensor) -> torch.Tensor:
    """Q5_K's bit planes ``[N, K / 8]`` as the per-group words of Q5_0's order (a little-endian
    uint32 a group, bit ``j`` element ``j``'s), ``[N, K / 8]``: what the per-group paths read (the
    fp32-scale fallback at load: 14 ms of one thread for 8192 x 2048, against 91 ms bit by bit).

    Eight bytes to an int64: the planes back into the file's ``qh`` (bit g of byte j: element j of
    group g; the planes' even bits of bytes 0-15 and 16-31 are its bytes 0-15, their odd bits its
    16-31), then each 8 x 8 bit matrix of eight bytes (elements 8k .. 8k + 7) by eight groups
    transposed in three swaps of bit blocks, so byte g of word k is group g's byte k."""
    even = 0x5555555555555555
    n = planes.shape[0]
    words = planes.contiguous().view(n, -1, 32).view(torch.int64)  # [N, B, 4]
    a, b = words[..., :2], words[..., 2:]
    # Arithmetic shifts right are masked to the bits they keep; no shift left reaches bit 63 unmasked.
    x = torch.cat(((a & even) | ((b & even) << 1), ((a >> 1) & even) | (b & ~even)), dim=-1)
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        swap = (x ^ (x >> shift)) & mask
        x = x ^ swap ^ (swap << shift)
    return x.view(torch.uint8).unflatten(-1, (4, 8)).transpose(-1, -2).reshape(n, -1)


def is_int4(qweight: torch.Tensor) -> bool:
    """Whether a packed weight is in the int4 (or int5, int6) layout: two weights a byte of ``qweight``
    (uint8)."""
    return qweight.dtype == torch.uint8


def is_int6(qweight: torch.Tensor, group_size: int) -> bool:
    """Whether a packed weight is in the int6 layout (Q6_K's): int4's bytes in groups of 16."""
    return is_int4(qweight) and group_size == 16


def has_mins(qweight: torch.Tensor, group_size: int) -> bool:
    """Whether the layout takes a min per group (int4 and int5: stored or implied; not int8, int6)."""
    return is_int4(qweight) and not is_int6(qweight, group_size)


def int4_mins(scales: torch.Tensor, mins: torch.Tensor | None, int5: bool = False) -> torch.Tensor:
    """An int4 (``int5``: int5) weight's mins in fp32: ``mins``, or where None Q4_0's ``-8 * scales``
    (Q5_0's ``-16 * scales``; exact)."""
    if mins is not None:
        return mins.float()
    return scales.float() * (-16.0 if int5 else -8.0)


SUPER_BLOCK = 256  # weights per super-block of the K formats


def super_scales_ref(
    records: torch.Tensor, int4: bool, group_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The K formats' scales, ``records [N, K / 256, R]`` uint8, as fp32 ``scales [N, K / G]`` and
    (int4) ``mins``. Per super-block of 256 weights: fp16 ``d``, for int4 (Q4_K, G 32) fp16 ``dmin``
    and then 8 uint8 ``sc`` and 8 uint8 ``m`` (R 20), for int8 (Q6_K, G 16) 16 int8 ``sc`` (R 18);
    a group's scale is ``d * sc`` and its min ``-(dmin * m)``, each exact in fp32."""
    per = SUPER_BLOCK // group_size
    d = records[..., 0:2].contiguous().view(torch.float16).float()  # [N, B, 1]
    if not int4:
        sc = records[..., 2 : 2 + per].view(torch.int8).float()  # [N, B, per]
        return (d * sc).flatten(1), None
    dmin = records[..., 2:4].contiguous().view(torch.float16).float()
    sc, m = records[..., 4 : 4 + per].float(), records[..., 4 + per : 4 + 2 * per].float()
    return (d * sc).flatten(1), (-(dmin * m)).flatten(1)


def group_scales(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    qhigh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A packed weight's scales (and int4 or int5 mins) per group in fp32 (fp16 converts exactly;
    Q4_0's and Q5_0's mins are implied; the K formats' records decoded by ``super_scales_ref``)."""
    int4 = has_mins(qweight, group_size)
    if scales.dim() == 3:
        return super_scales_ref(scales, int4, group_size)
    return scales.float(), int4_mins(scales, mins, qhigh is not None) if int4 else None


def quant_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    qhigh: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of ``kernels.cpu_quant_linear.quant_linear``: ``x [M, K] @ W^T`` in fp32, W packed."""
    return x.float() @ dequantize_packed_ref(qweight, scales, mins, group_size, qhigh).T


def quantize_rows_i8_ref(
    x: torch.Tensor, group_size: int, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x [M, K]`` rounded to int8 (or int16) per group of ``group_size``, as
    ``quant_linear_i8`` (``_i16``) does: scale ``d = amax / 127`` (``/ 32767``),
    ``q = round(x * (1 / d))`` half to even, in fp32. A group holding a NaN or an infinity
    gets a NaN scale (and zeros). Returns ``q [M, groups, group_size]`` and ``d [M, groups]``."""
    groups = x.float().unflatten(1, (-1, group_size))
    d = groups.abs().amax(-1) / torch.iinfo(dtype).max
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    finite = groups.sum(-1).isfinite()
    q = torch.where(finite[..., None], torch.round(groups * inv[..., None]), 0).to(dtype)
    return q, torch.where(finite, d, torch.nan)


def rounds_per_super_block(qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``quant_linear_i8`` rounds x per super-block of 256 against this weight (Q4_K, Q5_K and
    Q6_K: the int4, int5 or int6 layout with the K formats' records) rather than per weight group."""
    return scales.dim() == 3 and is_int4(qweight)


def quant_linear_i8_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.int8,
    qhigh: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of ``kernels.cpu_quant_linear.quant_linear_i8`` (``_i16`` with ``dtype`` int16):
    ``x [M, K] @ W^T`` with x rounded to ``dtype`` per weight group; per group an exact
    integer dot times the two scales, plus for int4 and int5 the min times the sum of the rounded
    x over the group: W times x rounded, exactly, up to the order of fp32 sums.

    Q4_K, Q5_K and Q6_K with their records (``rounds_per_super_block``; int8 only) take the
    super-block path instead: x rounded per 256 (``_quant_linear_super_ref``)."""
    if dtype == torch.int8 and rounds_per_super_block(qweight, scales):
        return _quant_linear_super_ref(x, qweight, scales, group_size, qhigh)
    xq, xs = quantize_rows_i8_ref(x, group_size, dtype)  # [M, G, g], [M, G]
    wq = packed_values(qweight, group_size, qhigh, planes=scales.dim() == 3)
    scales, mins = group_scales(qweight, scales, mins, group_size, qhigh)
    # Integer dots exact in float64, then rounded to fp32 as the kernel's conversion does.
    dots = torch.einsum("mgj,ngj->mng", xq.double(), wq.double()).float()
    y = (dots * (xs[:, None, :] * scales[None])).sum(-1)
    if mins is not None:
        y = y + (xs * xq.sum(-1).float()) @ mins.T
    return y


def _quant_linear_super_ref(
    x: torch.Tensor, qweight: torch.Tensor, records: torch.Tensor, group_size: int, qhigh: torch.Tensor | None
) -> torch.Tensor:
    """``quant_linear_i8``'s super-block path (llama.cpp's Q4_K and Q6_K x Q8_K dots): each row of x
    rounded to int8 per 256 (``quantize_rows_i8_ref``), and per super-block the exact integers
    ``sum_g sc_g dot_g`` and (Q4_K, Q5_K) ``sum_g m_g sum(x_g)``, each converted to fp32 and multiplied
    by ``d * xs`` (``dmin * xs``), rounded to fp32 as the kernel forms it: W times x rounded, up to
    the order of the fp32 sums over super-blocks."""
    xq, xs = quantize_rows_i8_ref(x, SUPER_BLOCK, torch.int8)  # [M, B, 256], [M, B]
    per = SUPER_BLOCK // group_size
    mins = has_mins(qweight, group_size)
    d = records[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [N, B]
    first = 4 if mins else 2  # of the sc bytes
    sc = records[..., first : first + per]  # [N, B, per]
    sc = (sc if mins else sc.view(torch.int8)).double()
    wq = (
        packed_values(qweight, group_size, qhigh, planes=True).unflatten(1, (-1, per)).double()
    )  # [N, B, per, G]
    xg = xq.unflatten(2, (per, group_size)).double()  # [M, B, per, G]
    dots = torch.einsum("mbgj,nbgj->mnbg", xg, wq)  # exact in float64
    sums = torch.einsum("mnbg,nbg->mnb", dots, sc).float()  # [M, N, B]
    y = sums * (d[None] * xs[:, None])
    if mins:
        dmin = records[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        m = records[..., 4 + per : 4 + 2 * per].double()
        min_sums = torch.einsum("mbg,nbg->mnb", xg.sum(-1), m).float()
        y = y - min_sums * (dmin[None] * xs[:, None])
    return y.sum(-1)


HADAMARD_BLOCKS = (4, 16, 64)  # powers of 4: 1 / sqrt(block) is a power of two, exact


def hadamard_rows_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each row of ``x [T, K]`` (in fp32) times an orthonormal Walsh-Hadamard matrix over
    each block of ``block`` consecutive columns. Rotating x and W alike leaves ``x W^T``
    unchanged and spreads an outlier column over ``block`` columns, so rounding each row to
    int8 loses far less (README, "int8 dense copy"). Stage h turns each pair of columns
    (i, i + h), i with bit h clear, into (a + c, a - c), as the compiled kernel does: the two
    agree bit for bit."""
    rows, k = x.shape
    # 1 / sqrt(block) is a power of two: scaling first is exact, as the kernel does it.
    y = (x.float() * (1.0 / math.sqrt(block))).reshape(rows, k // block, block)
    h = 1
    while h < block:
        pairs = y.view(rows, k // block, block // (2 * h), 2, h)
        a, c = pairs[:, :, :, 0], pairs[:, :, :, 1]
        y = torch.stack((a + c, a - c), dim=3).view(rows, k // block, block)
        h *= 2
    return y.view(rows, k)


def quantize_rows_int8_ref(x: torch.Tensor, hadamard_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``kernels.cpu_fused.quantize_rows_int8``: each row of ``x [T, K]`` (rotated by
    ``hadamard_rows_ref`` where ``hadamard_block`` is not 0) one group of
    ``quantize_rows_i8_ref``; returns ``q [T, K]`` int8 and ``scale [T]`` fp32."""
    if hadamard_block:
        x = hadamard_rows_ref(x, hadamard_block)
    q, d = quantize_rows_i8_ref(x, x.shape[1])
    return q.flatten(1), d.flatten()


def scale_int32_ref(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Twin of ``kernels.cpu_fused.scale_int32``: ``acc * row_scale[:, None] * col_scale (+ bias)``
    in fp32, in that order, rounded to ``dtype``."""
    y = acc.float() * row_scale[:, None] * col_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def check_quantize_rows_int8_args(x: torch.Tensor, hadamard_block: int = 0) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, K], got {list(x.shape)}.")
    if hadamard_block and (hadamard_block not in HADAMARD_BLOCKS or x.shape[1] % hadamard_block):
        raise ValueError(
            f"hadamard_block must be 0 or one of {HADAMARD_BLOCKS} dividing K = {x.shape[1]}, "
            f"got {hadamard_block}."
        )
    _check_float("x", x, cpu=True)
    _check_rows("x", x, tuple(x.shape), x.dtype)


def check_scale_int32_args(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> None:
    # int32 from torch._int_mm; float32 (the same integers) from oneDNN's int8 GEMM.
    if acc.dim() != 2 or acc.dtype not in (torch.int32, torch.float32) or not acc.is_contiguous():
        raise ValueError(
            f"acc must be a contiguous [T, N] int32 or float32 tensor, got {list(acc.shape)} {acc.dtype}."
        )
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the output dtype must be torch.float32 or torch.bfloat16, got {dtype}.")
    rows, n = acc.shape
    _check_rows("row_scale", row_scale, (rows,), torch.float32)
    _check_rows("col_scale", col_scale, (n,), torch.float32)
    if bias is not None:
        _check_rows("bias", bias, (n,), dtype)
    if any(t.device.type != "cpu" for t in (acc, row_scale, col_scale)):
        raise ValueError("the fused CPU kernels take CPU tensors only.")


def scale_silu_quantize_int8_ref(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    hadamard_block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``kernels.cpu_fused.scale_silu_quantize_int8``: the gate/up GEMM's int32 result
    ``acc [T, 2I]`` scaled back to ``dtype``, ``silu(gate) * up``, rounded for the down GEMM."""
    gate_up = scale_int32_ref(acc, row_scale, col_scale, None, dtype)
    return quantize_rows_int8_ref(silu_and_mul_ref(gate_up), hadamard_block)


def check_scale_silu_quantize_int8_args(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    hadamard_block: int,
    dtype: torch.dtype,
) -> None:
    check_scale_int32_args(acc, row_scale, col_scale, None, dtype)
    if acc.shape[1] % 2:
        raise ValueError(f"acc must be [T, 2I] (gate, up), got {list(acc.shape)}.")
    half = acc.shape[1] // 2
    if hadamard_block and (hadamard_block not in HADAMARD_BLOCKS or half % hadamard_block):
        raise ValueError(
            f"hadamard_block must be 0 or one of {HADAMARD_BLOCKS} dividing I = {half}, got {hadamard_block}."
        )


def round_activations_ref(x: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [M, K]`` rounded to the ``dtype`` grid of ``quantize_rows_i8_ref``, back in fp32
    (``q * d``): what the integer-activation kernels multiply W by, for the fp32 kernels."""
    q, d = quantize_rows_i8_ref(x, group_size, dtype)
    return (q.float() * d[..., None]).flatten(1)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}.")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension.")


def _check_float(name: str, t: torch.Tensor, cpu: bool) -> None:
    dtypes = (torch.float32, torch.bfloat16) if cpu else _FLOAT_DTYPES
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {', '.join(map(str, dtypes))}, got {t.dtype}.")
    if cpu and t.device.type != "cpu":
        raise ValueError(f"the fused CPU kernels take CPU tensors only; {name} is on {t.device}.")


def check_fused_add_rms_norm_args(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, *, cpu: bool = False
) -> None:
    """``x [T, N]``, ``weight [N]`` and ``residual [T, N]`` (or None) of one float dtype; ``cpu``
    adds what the compiled CPU kernels need (fp32 or bf16, CPU tensors)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, N], got {list(x.shape)}.")
    _check_float("x", x, cpu)
    _check_rows("weight", weight, (x.shape[1],), x.dtype)
    _check_rows("x", x, tuple(x.shape), x.dtype)
    if residual is not None:
        _check_rows("residual", residual, tuple(x.shape), x.dtype)
        if residual.device != x.device or weight.device != x.device:
            raise ValueError("x, residual and weight must be on one device.")


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Twin of ``kernels.cpu_fused.fused_add_rms_norm``, in place as vLLM's:
    ``residual = x + residual``, then ``x = norm(residual) * weight``."""
    check_fused_add_rms_norm_args(x, weight, residual)
    out, new_residual = rms_norm_ref(x, weight, eps, residual)
    residual.copy_(new_residual)
    x.copy_(out)


def check_silu_and_mul_args(x: torch.Tensor, *, cpu: bool = False) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I] (gate, up), got {list(x.shape)}.")
    _check_float("x", x, cpu)
    _check_rows("x", x, tuple(x.shape), x.dtype)


def check_rotary_args(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    *,
    cpu: bool = False,
) -> None:
    """query ``[T, H * D]`` and key ``[T, KVH * D]`` of one dtype, positions ``[T]`` integers
    inside the fp32 ``[P, D]`` cos and sin tables."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be even and positive, got {head_dim}.")
    if query.dim() != 2 or key.dim() != 2 or query.shape[1] % head_dim or key.shape[1] % head_dim:
        raise ValueError(
            f"query and key must be [T, heads * {head_dim}], got {list(query.shape)} and {list(key.shape)}."
        )
    _check_float("query", query, cpu)
    _check_rows("query", query, tuple(query.shape), query.dtype)
    _check_rows("key", key, (query.shape[0], key.shape[1]), query.dtype)
    if positions.shape != (query.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be [T] int32 or int64, got {list(positions.shape)} {positions.dtype}."
        )
    if cos.dim() != 2 or cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [P, {head_dim}], got {list(cos.shape)} and {list(sin.shape)}.")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rows(name, table, tuple(cos.shape), torch.float32)
    if cpu and cos.stride() != sin.stride():
        raise ValueError("cos and sin must share one layout.")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}).")
