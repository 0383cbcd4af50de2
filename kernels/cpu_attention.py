"""The compiled CPU decode-attention kernel (``csrc/cpu_paged_attention.cpp``).

Built by ``kernels.cpu_build`` at ``make install`` (``python -m
kernels.cpu_attention``), else on first use (about 20 s; later processes
load the cached build). ``load()`` raises
``KernelUnavailable`` with the reason when the build cannot happen (no
compiler, no ninja); the worker then falls back to the torch path.

Its torch twin is ``kernels.reference.paged_attention_ref`` with one query
token per sequence.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.cpu_build import KernelUnavailable, build, target_isa
from kernels.reference import check_query_and_cache

__all__ = ["KernelUnavailable", "check_decode_args", "load", "paged_decode_attention", "target_isa"]

SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.cpp"


@functools.cache
def load() -> None:
    """Build (or load the cached build of) the kernel and register ``torch.ops.weft_cpu``."""
    build("weft_cpu_paged_attention", SOURCE, "the CPU attention kernel")


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

    ``check=False`` skips the argument checks, for callers that built the
    arguments themselves and checked them once (an attention layer runs the
    kernel once per layer on the same step metadata).
    """
    if check:
        check_decode_args(query, kv_cache, token_idx, seq_lens, block_table, out)
    load()
    if window < 0:
        raise ValueError(f"window must be 0 (full attention) or positive, got {window}.")
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
    """A ValueError naming the first argument the kernel cannot take; it reads
    memory through all of them, so they are checked in full, bounds included."""
    check_query_and_cache(query, kv_cache)
    num_tokens = query.shape[0]
    _, _, num_blocks, block_size, _ = kv_cache.shape
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out must match query ({tuple(query.shape)} {query.dtype}), got {tuple(out.shape)} {out.dtype}."
        )
    if any(t.device.type != "cpu" for t in (query, kv_cache, token_idx, seq_lens, block_table, out)):
        raise ValueError("the CPU attention kernel takes CPU tensors only.")
    if out.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("out must be contiguous in the head dimension, and kv_cache contiguous.")
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
    if n == 0:
        return
    if int(token_idx.min()) < 0 or int(token_idx.max()) >= num_tokens:
        raise ValueError(f"token_idx must lie in [0, {num_tokens}).")
    lens_min, lens_max = int(seq_lens.min()), int(seq_lens.max())
    if lens_min < 1 or lens_max > block_table.shape[1] * block_size:
        raise ValueError(
            f"seq_lens must lie in [1, {block_table.shape[1] * block_size}] (block_table columns x block size), "
            f"got [{lens_min}, {lens_max}]."
        )
    used = torch.arange(block_table.shape[1]) < ((seq_lens + block_size - 1) // block_size)[:, None]
    ids = block_table[used]
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise ValueError(f"block_table entries in use must lie in [0, {num_blocks}).")


if __name__ == "__main__":  # build ahead of first use (the Docker image does)
    load()
    print(f"built and loaded the CPU attention kernel ({target_isa()[0]})")
