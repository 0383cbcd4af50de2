"""The Triton attention backend: paged attention and cache writes as kernels.

The torch backend (``attention.py``) splits a step into decode groups and
per-sequence prefills, each a separate SDPA call over gathered K/V. The
Triton kernel needs none of that: it reads K/V in place through the block
table, so its metadata is the flattened batch itself (query offsets,
sequence lengths, block table), a few small int32 tensors whose shapes
depend only on the batch size. That is also what lets a decode step be
captured once as a CUDA graph and replayed with new values.

Which backend runs is chosen once per engine (``backends.py``) and reaches
the layers through the forward context. Norms, rotary and the
MLP activation follow the same choice. Triton is imported only when this
backend runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TritonAttentionMetadata:
    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # [T] long: where each token's K/V is written (-1: nowhere)
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32: context + this step's tokens
    block_table: torch.Tensor  # [R, max_blocks] int32, rows padded with block 0
    max_query_len: int  # 1: a decode-only step

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


def build_triton_metadata(
    *,
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    device: torch.device | str = "cpu",
) -> TritonAttentionMetadata:
    """The same inputs as ``build_attention_metadata``; ``block_table`` is ``[R, max_blocks]``."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    query_start = np.concatenate(([0], np.cumsum(query_lens)))
    seq_lens = np.asarray(context_lens, dtype=np.int64) + query_lens

    def to_device(array: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(device, non_blocking=True)

    return TritonAttentionMetadata(
        num_tokens=int(query_start[-1]),
        block_size=block_size,
        slot_mapping=to_device(slot_mapping, np.int64),
        query_start_loc=to_device(query_start, np.int32),
        seq_lens=to_device(seq_lens, np.int32),
        block_table=to_device(block_table, np.int32),
        max_query_len=int(query_lens.max(initial=0)),
    )


def triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor | None,
    meta: TritonAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key and value [T, KVH, D] -> [T, H, D]: write this step's K/V, then attend."""
    from kernels.kv_cache import write_kv_cache
    from kernels.paged_attention import paged_attention

    if cache is None:
        raise RuntimeError("The Triton attention backend reads K/V from the cache; this forward has none.")
    write_kv_cache(key, value, cache, meta.slot_mapping)
    return paged_attention(
        query,
        cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        scale,
        max_query_len=meta.max_query_len,
    )
