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
    num_decodes: int = 0  # rows of one query in a mixed step (split over their keys like a decode step's)

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
    staging: StepStaging | None = None,
    staging_prefix: str = "",
) -> TritonAttentionMetadata:
    """The same inputs as ``build_attention_metadata``; ``block_table`` is ``[R, max_blocks]``, of which
    only the columns the step's longest sequence reaches are copied to the device. ``staging``: the
    worker's pinned host buffers, reused every step (else a plain copy), under names that start with
    ``staging_prefix`` (one per KV cache group)."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    query_start = np.concatenate(([0], np.cumsum(query_lens)))
    seq_lens = np.asarray(context_lens, dtype=np.int64) + query_lens
    used_columns = max(1, -(-int(seq_lens.max(initial=0)) // block_size))
    if staging is not None:

        def copy(name: str, array: np.ndarray, dtype) -> torch.Tensor:
            return staging.to_device(staging_prefix + name, array, dtype)

    else:
        copy = _plain_copy(device)
    max_query_len = int(query_lens.max(initial=0))
    return TritonAttentionMetadata(
        num_tokens=int(query_start[-1]),
        block_size=block_size,
        slot_mapping=copy("slot_mapping", slot_mapping, np.int64),
        query_start_loc=copy("query_start_loc", query_start, np.int32),
        seq_lens=copy("seq_lens", seq_lens, np.int32),
        block_table=copy("block_table", np.asarray(block_table)[:, :used_columns], np.int32),
        max_query_len=max_query_len,
        num_decodes=int(np.count_nonzero(query_lens == 1)) if max_query_len > 1 else 0,
    )


def _plain_copy(device: torch.device | str):
    def copy(name: str, array: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(device, non_blocking=True)

    return copy


class StepStaging:
    """Pinned host buffers, one per named step tensor, kept for the worker's life: a step's small
    tensors reach the GPU by an asynchronous copy from page-locked memory instead of a synchronous one
    from pageable memory (vLLM's persistent pinned buffers). A buffer is rewritten only once its last
    copy has run (an event recorded after it: a step that samples nothing never waits for the GPU)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._host: dict[str, torch.Tensor] = {}
        self._copied: dict[str, torch.cuda.Event] = {}

    def to_device(self, name: str, array: np.ndarray, dtype) -> torch.Tensor:
        array = np.ascontiguousarray(array, dtype=dtype)
        if self.device.type != "cuda":  # a copy to the host itself would alias the buffer
            return torch.from_numpy(array.copy())
        host = self._host.get(name)
        if host is None or host.numel() < array.size or host.numpy().dtype != array.dtype:
            size = max(1024, 1 << max(0, array.size - 1).bit_length())
            host = torch.from_numpy(np.empty(size, dtype=array.dtype))
            host = host.pin_memory() if self.device.type == "cuda" else host
            self._host[name] = host
        if (copied := self._copied.get(name)) is not None:
            copied.synchronize()  # the last copy out of this buffer has run
        staged = host[: array.size]
        staged.numpy()[:] = array.reshape(-1)
        on_device = staged.view(array.shape).to(self.device, non_blocking=True)
        event = self._copied[name] = torch.cuda.Event()
        event.record()
        return on_device


def triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor | None,
    meta: TritonAttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """query [T, H, D], key and value [T, KVH, D] -> [T, H, D]: write this step's K/V, then attend
    (``window > 0``: a sliding-window layer's last ``window`` keys)."""
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
        num_decodes=meta.num_decodes,
        window=window,
    )
