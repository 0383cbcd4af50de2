"""A step's attention metadata as a sliding-window layer sees it.

A window layer lets the token at position ``q`` attend to keys ``k`` with
``q - window < k <= q`` (its own key and the ``window - 1`` before it, as
Hugging Face's ``sliding_window_overlay`` and vLLM do). The step's
metadata is built once for full attention; this derives the window view
once per step and window size, shared by every window layer.

Blocks that hold only keys no query of the step can see are cut from the
front of each block table, so a window layer gathers at most the window's
blocks whatever the sequence length, and never reads a block the KV cache
manager has freed for window layers (its table entry is the null block).

With the compiled CPU decode kernel (``paged_decodes``), decodes stay as
they are: the layer passes its window to the kernel, which starts reading
at the window's first block.
"""

from __future__ import annotations

import dataclasses

import torch

from services.worker.layers.attention_metadata import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSeq,
)


def window_metadata(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    cached = meta.windows.get(window)
    if cached is None:
        cached = meta.windows[window] = _build(meta, window)
    return cached


def _build(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    bs = meta.block_size
    groups = [
        _window_group(
            g.token_idx,
            g.block_ids.view(g.token_idx.numel(), g.num_blocks),
            g.mask[0, :, 0, :].sum(-1),
            bs,
            window,
        )
        for g in meta.decode_groups
    ]
    prefills = [_window_prefill(seq, bs, window, meta.slot_mapping.device) for seq in meta.prefills]
    return dataclasses.replace(meta, decode_groups=groups, prefills=prefills, windows={})


def _window_group(
    token_idx: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, bs: int, window: int
) -> DecodeGroup:
    """Decodes with block tables ``table`` [n, nb] and ``lens`` keys each (the new one included)."""
    first = (lens - window).clamp(min=0) // bs  # [n] first block holding a visible key
    used = (lens + bs - 1) // bs - first
    nb = int(used.max())
    cols = first[:, None] + torch.arange(nb, device=table.device)[None, :]  # [n, nb]
    in_table = cols < table.shape[1]
    block_ids = torch.where(in_table, table.gather(1, cols.clamp(max=table.shape[1] - 1)), 0)
    key_pos = (first * bs)[:, None] + torch.arange(nb * bs, device=table.device)[None, :]  # [n, nb * bs]
    mask = (key_pos < lens[:, None]) & (key_pos >= (lens - window)[:, None])
    return DecodeGroup(
        token_idx=token_idx, block_ids=block_ids.reshape(-1), mask=mask[None, :, None, :], num_blocks=nb
    )


def _window_prefill(seq: PrefillSeq, bs: int, window: int, device: torch.device) -> PrefillSeq:
    n = seq.end - seq.start
    context = seq.context_len
    if seq.block_ids is None and n <= window:
        return seq  # plain causal already stays inside the window
    # Keys before the first query's window are seen by no query of the chunk: drop their blocks.
    skip = max(0, context - window + 1) // bs if seq.block_ids is not None else 0
    kept_context = context - skip * bs
    query_pos = kept_context + torch.arange(n, device=device)[:, None]
    key_pos = torch.arange(kept_context + n, device=device)[None, :]
    mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
    block_ids = None if seq.block_ids is None else seq.block_ids[skip:]
    return PrefillSeq(seq.start, seq.end, kept_context, block_ids, mask)
