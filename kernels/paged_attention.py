"""Paged attention over a flattened mixed batch, as Triton kernels.

One kernel serves every request shape a step can hold: prefill chunks,
prefix-cache hits (queries that start mid-context), speculative
verification (a few queries after a long context) and single-token decodes.
Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
its ``seq_lens[i]`` keys (context + the new tokens, already written to the
cache) are read block by block through ``block_table[i]``. Query ``j`` of a
request sits at absolute position ``seq_len - query_len + j`` and sees the
keys up to and including that position.

A program owns one KV head and a tile of ``BLOCK_Q`` queries of one request;
its ``BLOCK_M`` rows are the (query, head) pairs of those queries with the
``GROUP`` query heads that share the KV head, so each key tile loaded serves
the whole group (GQA/MQA at the cost of one load).

Long decodes are split over the keys ("split-K"): a third grid axis gives
each program a slice of the key tiles, and ``_reduce_splits_kernel`` merges
the slices' partial softmax states. The split count depends only on the
batch's shape, never on sequence lengths, so a CUDA graph captured once
replays for any lengths. In a mixed step the decode rows are split the same
way; the rows of several queries run whole in the first split.

A sliding-window layer passes its ``window``: a query sees its last
``window`` keys, and no key tile before the window of a program's first
query is read.

Cache layout: ``[2, num_kv_heads, num_blocks, block_size, head_dim]``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels import interpreting
from kernels.reference import check_paged_attention_args

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16


@triton.jit
def _find_request(query_start_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The request whose query tiles include tile ``q_block``.

    Request ``i``'s tiles start at ``query_start[i] // BLOCK_Q + i`` (an upper
    bound on the tiles of the requests before it), so a binary search over
    ``query_start`` finds it without a per-step table built on the host.
    """
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_key_tiles(
    q,
    q_pos,
    k_base,
    stride_kv,
    table_ptr,
    tile_lo,
    tile_hi,
    kv_start,
    kv_end,
    window,
    scale_log2,
    stride_kb,
    stride_ks,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Online softmax of queries ``q [M, Dp]`` over key tiles ``[tile_lo, tile_hi)`` of one sequence.

    Keys outside ``[kv_start, kv_end)`` are never loaded; with ``window > 0`` a query at position
    ``p`` sees the keys ``p - window < key <= p`` (a sliding-window layer).

    Returns the running max (log2 units), the running sum of ``exp2(score - max)``
    and the unnormalized output ``[M, Dp]``, all fp32.
    """
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    v_base = k_base + stride_kv
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = (keys >= kv_start) & (keys < kv_end)
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0)
        slot = block.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_ks  # [N]
        # Masked loads matter beyond the mask below: 0 * NaN from an unwritten slot is NaN.
        k = tl.load(
            k_base + slot[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0
        )  # [Dp, N]
        v = tl.load(
            v_base + slot[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0
        )  # [N, Dp]
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [M, N]
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])  # causal
        visible = visible & ((keys[None, :] > q_pos[:, None] - window) | (window == 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 then, not by -inf (NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    part_acc_ptr,  # [T, H, NUM_SPLITS, D] fp32 (split-K only)
    part_max_ptr,  # [T, H, NUM_SPLITS] fp32 (split-K only)
    part_sum_ptr,  # [T, H, NUM_SPLITS] fp32 (split-K only)
    q_ptr,  # [T, H, D]
    kv_ptr,  # [2, KVH, num_blocks, block_size, D]
    block_table_ptr,  # [R, max_blocks] int32
    query_start_ptr,  # [R + 1] int32
    seq_lens_ptr,  # [R] int32
    scale_log2,  # softmax scale * log2(e): scores are exponentiated base 2
    num_seqs,
    window,  # > 0: a sliding-window layer's window, in keys
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * GROUP, a power of two
    TILE_N: tl.constexpr,  # keys per loop iteration
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    NUM_SPLITS: tl.constexpr,  # split-K factor of the decode rows (one query); other rows are not split
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # the interpreter's tl.dot reads bf16 as raw integers
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq = _find_request(query_start_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # this tile's first query, within the request
    if first >= q_len:
        return  # a spare tile of the grid's upper bound
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_local = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    token = (q_start + q_local).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [M, Dp]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = context + q_local  # [M] absolute positions

    # The tile's last query sees the most keys; the keys past it are masked for all rows. In a
    # window layer the tile's first query sees the earliest key: none before it is loaded.
    kv_end = tl.minimum(seq_len, context + first + BLOCK_Q)
    kv_start = tl.where(window > 0, tl.maximum(context + first - window + 1, 0), 0)
    first_tile = kv_start // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N) - first_tile
    # Only decode rows are split: a mixed step's rows of several queries run whole, in split 0.
    if NUM_SPLITS > 1:
        if (q_len > 1) & (split > 0):
            return
    splits = tl.where(q_len > 1, 1, NUM_SPLITS)
    tiles_per_split = tl.cdiv(num_tiles, splits)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(first_tile + num_tiles, tile_lo + tiles_per_split)

    m_i, l_i, acc = _attend_key_tiles(
        q,
        q_pos,
        kv_ptr + kv_head * stride_kh,
        stride_kv,
        block_table_ptr + seq * stride_bt,
        tile_lo,
        tile_hi,
        kv_start,
        kv_end,
        window,
        scale_log2,
        stride_kb,
        stride_ks,
        HEAD_DIM,
        HEAD_DIM_P,
        BLOCK_M,
        TILE_N,
        BLOCK_SIZE,
        DOT_PRECISION,
        UPCAST_DOT,
    )

    whole = q_len > 1
    if NUM_SPLITS == 1:
        whole = True
    if whole:
        # Padding rows past a window layer's queries see no key (l = 0): keep them finite.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # Partial states of a decode row, by request: [R, H, S] for max and sum, [R, H, S, D] for the
        # unnormalized output.
        state = (seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + state, m_i, mask=row_ok)
        tl.store(part_sum_ptr + state, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + state[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_SPLITS_P: tl.constexpr,
):
    """Merge one decode row's (request, head) split softmax states: rescale each to the global max
    and add. Rows of more than one query were not split and are skipped."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) - q_start != 1:
        return
    token = q_start.to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS_P)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    state = (seq * num_heads + head) * NUM_SPLITS + splits  # [S]
    m = tl.load(part_max_ptr + state, mask=split_ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + state, mask=split_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + state[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [S, Dp]
    m_max = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # empty splits weigh nothing
    total = tl.sum(part_sum * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok
    )


def paged_attention(
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
    num_decodes: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attention of query ``[T, H, D]`` over the paged cache -> ``[T, H, D]`` (into ``out`` if given).

    ``query_start_loc [R + 1]``, ``seq_lens [R]`` and ``block_table [R, max_blocks]``
    are int32; ``max_query_len`` picks the tiling (1: a decode-only batch).
    ``num_kv_splits`` forces the split-K factor of the decode rows (default: enough programs to
    fill the GPU); ``num_decodes``, the decode rows of a mixed step (None: none unless the whole
    batch decodes), lets them be split there too. ``window > 0``: each query sees its last
    ``window`` keys (a sliding-window layer).
    """
    check_paged_attention_args(query, kv_cache, query_start_loc, seq_lens, block_table)
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be like query {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}."
        )
    if num_tokens == 0:
        return out
    block_m, block_q = _query_tiling(group, max_query_len)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: full attention), got {window}.")
    decodes = num_seqs if max_query_len == 1 else (num_decodes or 0)
    splits = (num_kv_splits or _decode_splits(query.device, decodes, num_kv_heads)) if decodes else 1
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    if splits > 1:
        part_acc = torch.empty(
            num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    _paged_attention_kernel[grid](
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        kv_cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale * _LOG2E,
        num_seqs,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=_tile_n(block_size, query.device),
        BLOCK_SIZE=block_size,
        NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=interpreting() and query.dtype == torch.bfloat16,
    )
    if splits > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            query_start_loc,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=triton.next_power_of_2(head_dim),
            NUM_SPLITS=splits,
            NUM_SPLITS_P=triton.next_power_of_2(splits),
        )
    return out


def _query_tiling(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_Q queries) per program; tl.dot needs at least 16 rows."""
    rows = max(16, triton.next_power_of_2(group))
    if max_query_len > 1:
        rows = max(rows, 64 if group * max_query_len >= 64 else 16)
    return rows, max(1, rows // group)


def _tile_n(block_size: int, device: torch.device) -> int:
    # Fewer, larger tiles make fewer Python steps under the interpreter too.
    return 64 if device.type == "cuda" or block_size >= 64 else 32


def _decode_splits(device: torch.device, num_seqs: int, num_kv_heads: int) -> int:
    """Split-K factor for a decode batch: enough programs for two waves over the SMs."""
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    want = math.ceil(2 * _sm_count(device.index or 0) / programs)
    return int(min(_MAX_SPLITS, triton.next_power_of_2(max(1, want)) if want > 1 else 1))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
