"""The compiled CPU paged-attention kernels, decode and prefill (``csrc/cpu_paged_attention.cpp``).

Built by ``kernels.cpu_build`` at ``make install`` (``python -m
kernels.cpu_attention``), else on first use (about 20 s; later processes
load the cached build). ``load()`` raises
``KernelUnavailable`` with the reason when the build cannot happen (no
compiler, no ninja); the worker then falls back to the torch path.

Their torch twin is ``kernels.reference.paged_attention_ref`` (decodes: one
query token per sequence).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from kernels.cpu_build import KernelUnavailable, bf16_isa, build, target_isa
from kernels.reference import check_query_and_cache

__all__ = [
    "KernelUnavailable",
    "bf16_dot_prefills",
    "check_decode_args",
    "check_prefill_args",
    "load",
    "paged_decode_attention",
    "paged_prefill_attention",
    "target_isa",
]

SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.cpp"
# "0" keeps bf16 prefills and decodes on the fp32 path where the bf16 dot products are built in, "1"
# (or unset) uses them; read by the kernel itself on every call (services/env.py declares it).
ENV_BF16_DOT = "WEFT_ATTENTION_BF16_DOT"


def check_bf16_dot_env() -> None:
    """Refuse a value of ``ENV_BF16_DOT`` other than 0 or 1 (the kernel refuses it too, per call)."""
    value = os.environ.get(ENV_BF16_DOT)
    if value is not None and value not in ("0", "1"):
        raise ValueError(f"{ENV_BF16_DOT} must be 0 or 1, got {value!r}.")


def bf16_dot_prefills(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs this cache dtype's prefills on bf16 dot products here: a bf16
    cache, a head size it has them for, an AVX512_BF16 build, and the switch not 0."""
    return (
        dtype == torch.bfloat16
        and head_dim in (64, 128, 256)
        and bf16_isa()[0] == "avx512bf16"
        and os.environ.get(ENV_BF16_DOT, "1") != "0"
    )


@functools.cache
def load() -> None:
    """Build (or load the cached build of) the kernel and register ``torch.ops.weft_cpu``: for the
    CPU's ``bf16_isa()``, whose AVX512_BF16 variant runs bf16 attention on bf16 dot products."""
    check_bf16_dot_env()
    build("weft_cpu_paged_attention", SOURCE, "the CPU attention kernel", isa=bf16_isa())


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
) -> None:
    """``out[token_idx[i]]`` = attention of ``query[token_idx[i]]`` ([H, D]) over the first
    ``seq_lens[i]`` keys and values of the blocks in ``block_table[i]`` — the last ``window`` of
    them when ``window > 0`` (a sliding-window layer; earlier blocks are not read).

    ``query`` and ``out`` are ``[T, H, D]``; ``kv_cache`` is ``[2, KVH, num_blocks,
    block_size, D]``; ``token_idx`` int64 ``[n]``, ``seq_lens`` int32 ``[n]``,
    ``block_table`` int32 ``[n, max_blocks]``. Rows of ``out`` not in
    ``token_idx`` are left as they are.

    ``check=False`` skips the Python checks of shapes and dtypes, for callers that built
    the arguments themselves and checked them once (an attention layer runs the kernel once
    per layer on the same step metadata); the kernel checks the index values on every call.
    """
    if check:
        check_decode_args(query, kv_cache, token_idx, seq_lens, block_table, out)
    _check_window(window)
    load()
    torch.ops.weft_cpu.paged_decode_attention(
        query, kv_cache, token_idx, seq_lens, block_table, float(scale), out, int(window)
    )


def check_decode_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    token_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """A ValueError naming the first argument the kernel cannot take, from shapes and dtypes
    alone (no tensor op: a few microseconds). The kernel itself checks the values it reads
    memory through (token_idx, seq_lens, the block ids in use) on every call, with the
    same ValueErrors."""
    check_query_and_cache(query, kv_cache)
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
    ``check`` as for ``paged_decode_attention``: the kernel checks the index values itself.
    """
    if check:
        check_prefill_args(query, kv_cache, query_start, query_lens, context_lens, block_table, out)
    _check_window(window)
    load()
    torch.ops.weft_cpu.paged_prefill_attention(
        query, kv_cache, query_start, query_lens, context_lens, block_table, float(scale), out, int(window)
    )


def check_prefill_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``check_decode_args`` for ``paged_prefill_attention``: shapes and dtypes, no tensor op."""
    check_query_and_cache(query, kv_cache)
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


def _check_window(window: int) -> None:
    if window < 0:
        raise ValueError(f"window must be 0 (full attention) or positive, got {window}.")


if __name__ == "__main__":  # build ahead of first use (the Docker image does)
    load()
    print(f"built and loaded the CPU attention kernels ({bf16_isa()[0]})")
