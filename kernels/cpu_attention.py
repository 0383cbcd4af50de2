"""The compiled CPU paged-attention kernels, decode and prefill (``csrc/cpu_paged_attention.cpp``
with ``csrc/cpu_attention_decode.cpp`` and ``csrc/cpu_attention_prefill.cpp``, one library).

Built by ``kernels.cpu_build`` at ``make install`` (``python -m
kernels.cpu_attention``), else on first use (about 20 s; later processes
load the cached build). ``load()`` raises
``KernelUnavailable`` with the reason when the build cannot happen (no
compiler, no ninja); the worker then falls back to the torch path.

Their torch twin is ``kernels.reference.paged_attention_ref`` (decodes: one
query token per sequence). Both kernels are batch-invariant on their default
paths: a query row's output is the same bits whatever else the call holds, on
any thread count, and a prefill's (or verify step's) row equals the decode of
that row at its context length (the rule heads ``csrc/cpu_paged_attention.cpp``;
the bf16 dot products of ``ENV_BF16_DOT`` and the int8 cache's AVX-512 decodes
are not, and are opt-in). Caches are of the query's dtype, or int8 with fp32
scales per (token, KV head) (``write_kv_int8`` writes them; twins
``write_kv_int8_ref`` and ``dequantize_kv_cache`` in ``kernels.reference``); ``write_kv`` writes
a cache of the query's dtype (twin ``kernels.reference.write_kv_cache_ref``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.cpu_build import KernelUnavailable, amx_isa, build, cpu_flags, target_isa
from kernels.reference import check_kv_int8_write_args, check_kv_write_args, check_query_and_cache
from services import env

__all__ = [
    "KernelUnavailable",
    "amx_prefills",
    "bf16_dot_prefills",
    "int8_dot_queries",
    "int8_fast_decodes",
    "check_decode_args",
    "check_prefill_args",
    "check_write_kv_args",
    "check_write_kv_int8_args",
    "decode_switches",
    "load",
    "paged_decode_attention",
    "paged_prefill_attention",
    "target_isa",
    "tile_prefills",
    "write_kv",
    "write_kv_int8",
]

_CSRC = Path(__file__).parent / "csrc"
# The library's files: the ops' registration (and the kernel's rules), then its two kernels; the
# headers beside them (paged_attention.h, simd_math.h, amx_tiles.h) are found by the compiler.
SOURCES = (
    _CSRC / "cpu_paged_attention.cpp",
    _CSRC / "cpu_attention_decode.cpp",
    _CSRC / "cpu_attention_prefill.cpp",
)
# The kernel's switches (services/env.py declares them), read here on every call and passed to the
# kernel as arguments. "1" runs bf16 prefills and decodes on bf16 dot products where they are built in
# (AVX512_BF16), "0" (or unset) keeps them on the fp32 path, the batch-invariant one.
ENV_BF16_DOT = "WEFT_ATTENTION_BF16_DOT"
# "0" keeps bf16 prefills on vdpbf16ps where the build has AMX tiles, "1" (or unset) runs their products
# on tiles.
ENV_AMX = "WEFT_ATTENTION_AMX"
# "0" keeps int8-cache decodes on the generic path where the AVX-512 one is built in (head sizes 64
# and 128), "1" (or unset) uses it.
ENV_INT8_FAST = "WEFT_ATTENTION_INT8_FAST"


def switch(name: str, unset: bool) -> bool:
    """A 0/1 switch of the kernel, ``unset`` where it is not set; any other value (empty included) is
    a ValueError naming it."""
    value = env.get_raw(name)
    if value is None:
        return unset
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}.")
    return value == "1"


def decode_switches() -> tuple[bool, bool]:
    """The decode kernel's (bf16_dot, int8_fast) arguments as the environment sets them: for callers
    of ``torch.ops.weft_cpu.paged_decode_attention`` itself (the lean decode path)."""
    return switch(ENV_BF16_DOT, False), switch(ENV_INT8_FAST, True)


def check_bf16_dot_env() -> None:
    """Refuse a value of ``ENV_BF16_DOT`` other than 0 or 1 (the calls refuse it too)."""
    switch(ENV_BF16_DOT, False)


def bf16_dot_prefills(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs this cache dtype's prefills on bf16 dot products here: a bf16
    cache (or a bf16 query over an int8 cache: pass the query's dtype), a head size it has them
    for, an AVX512_BF16 build, and the switch set to 1 (they are not batch-invariant: opt-in)."""
    return (
        dtype == torch.bfloat16
        and head_dim in (64, 128, 256)
        and amx_isa()[0] in ("avx512bf16", "amxbf16")
        and switch(ENV_BF16_DOT, False)
    )


def tile_prefills(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs this query dtype's prefills on its register tiles (the fp32 path,
    whose rows equal the decode kernel's bit for bit): every build, but where ``bf16_dot_prefills``."""
    return not bf16_dot_prefills(dtype, head_dim)


def amx_prefills(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether the kernel runs this cache dtype's prefills on AMX tiles here: where it runs them on
    bf16 dot products (``bf16_dot_prefills``), for head sizes of a multiple of 64 and block sizes of
    a multiple of 16, an AMX build (the CPU has amx_tile and amx_bf16), and ``ENV_AMX`` not 0. (The
    kernel also asks Linux for the tile state once; where that is refused it keeps vdpbf16ps.)"""
    return (
        bf16_dot_prefills(dtype, head_dim)
        and head_dim % 64 == 0
        and block_size % 16 == 0
        and amx_isa()[0] == "amxbf16"
        and switch(ENV_AMX, True)
    )


def int8_fast_decodes(head_dim: int) -> bool:
    """Whether decodes over an int8 cache run on the kernel's AVX-512 path here: head sizes 64 and
    128, a build with AVX-512 (``amx_isa()`` is one of its variants), and the switch not 0. Other
    head sizes run the generic path, which reads int8 rows at about half the bf16 path's speed."""
    return (
        head_dim in (64, 128)
        and amx_isa()[0] in ("avx512", "avx512bf16", "amxbf16")
        and switch(ENV_INT8_FAST, True)
    )


def int8_dot_queries(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decodes of this query dtype over an int8 cache run on int8 dot products here (the
    query rounded to int8 per head, ``kernels.reference.round_query_int8_ref``): bf16 queries on the
    fast path of an AVX512_BF16 build, on a CPU with AVX512_VNNI."""
    return (
        dtype == torch.bfloat16
        and int8_fast_decodes(head_dim)
        and amx_isa()[0] in ("avx512bf16", "amxbf16")
        and "avx512_vnni" in cpu_flags()
    )


@functools.cache
def load() -> None:
    """Build (or load the cached build of) the kernel and register ``torch.ops.weft_cpu``: for the
    CPU's ``amx_isa()``, whose AVX512_BF16 variants run bf16 attention on bf16 dot products and
    whose AMX one runs bf16 prefills on tiles."""
    check_bf16_dot_env()
    switch(ENV_INT8_FAST, True)
    switch(ENV_AMX, True)
    build("weft_cpu_paged_attention", SOURCES, "the CPU attention kernel", isa=amx_isa())


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    token_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    check: bool = True,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """``out[token_idx[i]]`` = attention of ``query[token_idx[i]]`` ([H, D]) over the first
    ``seq_lens[i]`` keys and values of the blocks in ``block_table[i]`` — the last ``window`` of
    them when ``window > 0`` (a sliding-window layer; earlier blocks are not read).

    ``query`` and ``out`` are ``[T, H, D]``; ``kv_cache`` is ``[2, KVH, num_blocks,
    block_size, D]``; ``token_idx`` int64 ``[n]``, ``seq_lens`` int32 ``[n]``,
    ``block_table`` int32 ``[n, max_blocks]``. Rows of ``out`` not in
    ``token_idx`` are left as they are. An int8 ``kv_cache`` takes its ``kv_scales``
    (float32 ``[2, KVH, num_blocks, block_size]``, as ``write_kv_int8`` writes them) and a
    float32, bfloat16 or float16 query; a float cache shares the query's dtype, no scales.

    ``check=False`` skips the Python checks of shapes and dtypes, for callers that built
    the arguments themselves and checked them once (an attention layer runs the kernel once
    per layer on the same step metadata); the kernel checks the index values on every call.
    """
    if check:
        check_decode_args(query, kv_cache, token_idx, seq_lens, block_table, out, kv_scales)
    _check_window(window)
    bf16_dot, int8_fast = decode_switches()
    load()
    torch.ops.weft_cpu.paged_decode_attention(
        query,
        kv_cache,
        token_idx,
        seq_lens,
        block_table,
        float(scale),
        out,
        int(window),
        kv_scales,
        bf16_dot,
        int8_fast,
    )


def check_decode_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    token_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """A ValueError naming the first argument the kernel cannot take, from shapes and dtypes
    alone (no tensor op: a few microseconds). The kernel itself checks the values it reads
    memory through (token_idx, seq_lens, the block ids in use) on every call, with the
    same ValueErrors."""
    check_query_and_cache(query, kv_cache, kv_scales)
    _check_out_and_device(query, kv_cache, out, (token_idx, seq_lens, block_table))
    n = token_idx.shape[0]
    if token_idx.dtype != torch.int64 or seq_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise ValueError(
            f"token_idx must be int64, seq_lens and block_table int32; got {token_idx.dtype}, "
            f"{seq_lens.dtype} and {block_table.dtype}."
        )
    if (
        token_idx.shape != (n,)
        or seq_lens.shape != (n,)
        or block_table.dim() != 2
        or block_table.shape[0] != n
    ):
        raise ValueError(
            f"token_idx and seq_lens must be [n] and block_table [n, max_blocks]; got {tuple(token_idx.shape)}, "
            f"{tuple(seq_lens.shape)} and {tuple(block_table.shape)}."
        )


def _check_out_and_device(
    query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, indices: tuple[torch.Tensor, ...]
) -> None:
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out must match query ({tuple(query.shape)} {query.dtype}), got {tuple(out.shape)} {out.dtype}."
        )
    if any(t.device.type != "cpu" for t in (query, kv_cache, out, *indices)):
        raise ValueError("the CPU attention kernel takes CPU tensors only.")
    if out.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("out must be contiguous in the head dimension, and kv_cache contiguous.")
    if not all(t.is_contiguous() for t in indices):
        raise ValueError("the index tensors (lengths, starts, block_table) must be contiguous.")


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    check: bool = True,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Prefills and prefill chunks, keys and values read in place from the cache (their new
    tokens' K/V already written there): the ``query_lens[i]`` rows of ``query`` from
    ``query_start[i]`` are positions ``context_lens[i]`` onwards of sequence ``i``, and
    each attends to every key of the sequence up to its own position (the last ``window``
    of them when ``window > 0``; blocks wholly before that are not read).

    ``query`` and ``out`` are ``[T, H, D]``; ``kv_cache`` is ``[2, KVH, num_blocks,
    block_size, D]``; ``query_start`` int64 ``[R]``; ``query_lens`` and ``context_lens``
    int32 ``[R]``; ``block_table`` int32 ``[R, max_blocks]``. Other rows of ``out`` are
    left as they are. Its torch twin is ``kernels.reference.paged_attention_ref``.
    ``check`` and ``kv_scales`` as for ``paged_decode_attention``: the kernel checks the index
    values itself. Over an int8 cache, bf16 queries take the bf16 dot products where
    ``bf16_dot_prefills`` says so (each chunk's keys and values, times their scales, rounded to
    bf16 first), other queries the fp32 path (each chunk dequantized to fp32).
    """
    if check:
        check_prefill_args(
            query, kv_cache, query_start, query_lens, context_lens, block_table, out, kv_scales
        )
    _check_window(window)
    bf16_dot, amx = switch(ENV_BF16_DOT, False), switch(ENV_AMX, True)
    load()
    torch.ops.weft_cpu.paged_prefill_attention(
        query,
        kv_cache,
        query_start,
        query_lens,
        context_lens,
        block_table,
        float(scale),
        out,
        int(window),
        kv_scales,
        bf16_dot,
        amx,
    )


def check_prefill_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """``check_decode_args`` for ``paged_prefill_attention``: shapes and dtypes, no tensor op."""
    check_query_and_cache(query, kv_cache, kv_scales)
    _check_out_and_device(query, kv_cache, out, (query_start, query_lens, context_lens, block_table))
    r = query_start.shape[0]
    if (
        query_start.dtype != torch.int64
        or query_lens.dtype != torch.int32
        or context_lens.dtype != torch.int32
    ):
        raise ValueError(
            f"query_start must be int64, query_lens and context_lens int32; got {query_start.dtype}, "
            f"{query_lens.dtype} and {context_lens.dtype}."
        )
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != r:
        raise ValueError(
            f"block_table must be int32 [{r}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}."
        )
    if query_lens.shape != (r,) or context_lens.shape != (r,):
        raise ValueError(
            f"query_start, query_lens and context_lens must all be [R]; got {tuple(query_start.shape)}, "
            f"{tuple(query_lens.shape)} and {tuple(context_lens.shape)}."
        )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """Token ``t``'s key and value (``[T, KVH, D]``, contiguous in D) copied into slot
    ``slot_mapping[t]`` (int64 ``[T]``) of ``kv_cache [2, KVH, num_blocks, block_size, D]`` of their
    dtype (float32, bfloat16 or float16); a negative slot skips the token. One call for both, where
    ``index_copy_`` takes two (``kernels.reference.write_kv_cache_ref``, its twin). The kernel checks
    the slots against the cache on every call (ValueError); ``check=False`` skips the Python checks."""
    if check:
        check_write_kv_args(key, value, kv_cache, slot_mapping)
    load()
    torch.ops.weft_cpu.write_kv(key, value, kv_cache, slot_mapping)


def check_write_kv_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``write_kv``'s shapes, dtypes, strides and devices (no tensor op): the twin's checks, and a
    cache of the key's dtype, contiguous, int64 slots, CPU tensors."""
    check_kv_write_args(key, value, kv_cache, slot_mapping)
    if key.dtype not in (torch.float32, torch.bfloat16, torch.float16) or value.dtype != key.dtype:
        raise ValueError(
            f"key and value must be float32, bfloat16 or float16 of one dtype, got {key.dtype}, {value.dtype}."
        )
    if (
        kv_cache.dtype != key.dtype
        or kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or not kv_cache.is_contiguous()
    ):
        raise ValueError(
            f"kv_cache must be a contiguous {key.dtype} [2, KVH, num_blocks, block_size, D], got "
            f"{kv_cache.dtype} {tuple(kv_cache.shape)}."
        )
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous int64, got {slot_mapping.dtype}.")
    if any(t.device.type != "cpu" for t in (key, value, kv_cache, slot_mapping)):
        raise ValueError("write_kv takes CPU tensors only.")


def write_kv_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """Token ``t``'s key and value (``[T, KVH, D]``, float32, bfloat16 or float16, contiguous in D)
    rounded to int8 per (token, KV head) row into slot ``slot_mapping[t]`` (int64 ``[T]``) of the
    int8 ``kv_cache [2, KVH, num_blocks, block_size, D]``, their fp32 scales into the same slot of
    ``kv_scales [2, KVH, num_blocks, block_size]``; a negative slot skips the token. The rounding
    is ``kernels.reference.quantize_kv_rows_ref``'s, bit for bit. The kernel checks the slots
    against the cache on every call (ValueError); ``check=False`` skips the Python checks."""
    if check:
        check_write_kv_int8_args(key, value, kv_cache, kv_scales, slot_mapping)
    load()
    torch.ops.weft_cpu.write_kv_int8(key, value, kv_cache, kv_scales, slot_mapping)


# ``write_kv_int8``'s shapes, dtypes, strides and devices (no tensor op: a few microseconds).
check_write_kv_int8_args = functools.partial(check_kv_int8_write_args, cpu=True)


def _check_window(window: int) -> None:
    if window < 0:
        raise ValueError(f"window must be 0 (full attention) or positive, got {window}.")


if __name__ == "__main__":  # build ahead of first use (the Docker image does)
    load()
    print(f"built and loaded the CPU attention kernels ({amx_isa()[0]})")
