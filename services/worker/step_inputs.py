"""Flatten one step's scheduled requests into the model's inputs.

Request ``i`` contributes ``query_lens[i]`` tokens starting at its
``num_computed_tokens``; they sit back to back in one super-sequence of
``T`` tokens. Everything is computed with numpy gathers over the persistent
batch's rows, then moved to the device once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol import TokenLogprobs
from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.layers.attention_metadata import AttentionMetadata, PrefillCaps, StepShape
from services.worker.layers.triton_attention import (
    StepStaging,
    TritonAttentionMetadata,
    build_triton_metadata,
)


@dataclass(frozen=True)
class StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_metadata: AttentionMetadata | TritonAttentionMetadata
    query_start: np.ndarray  # [R + 1]
    context_lens: np.ndarray  # [R]: tokens computed before this step
    # [R] bool: the step reaches the request's last known (or draft) token, so it samples.
    samples: np.ndarray
    # Every KV cache group's metadata, group 0's (attn_metadata) first; empty with one group.
    group_metadata: tuple[AttentionMetadata, ...] = ()

    @property
    def sample_token_index(self) -> np.ndarray:
        """Flat index of the last token of each sampling request."""
        return self.query_start[1:][self.samples] - 1


def prepare_step(
    batch: InputBatch,
    req_ids: list[str],
    num_scheduled: dict[str, int],
    device: torch.device | str,
    max_decode_group_tokens: int | None = None,
    num_drafts: dict[str, int] | None = None,
    attention_backend: str = "torch",
    prefill_caps: PrefillCaps | None = None,
    staging: StepStaging | None = None,
) -> StepInputs:
    """``num_drafts``: draft tokens written after a request's known tokens, to verify.
    ``attention_backend`` picks the metadata the layers get (``layers/backends.py``);
    ``prefill_caps`` which prefills the cpu backend's kernel takes (``attention_metadata.py``);
    ``staging``, the Triton backend's pinned host buffers (``triton_attention.StepStaging``)."""
    rows = np.array([batch.requests[r].row for r in req_ids], dtype=np.int64)
    query_lens = np.array([num_scheduled[r] for r in req_ids], dtype=np.int64)
    context = batch.num_computed_tokens[rows]
    seq_lens = context + query_lens
    known = batch.num_tokens[rows]
    if num_drafts:
        known = known + np.array([num_drafts.get(r, 0) for r in req_ids], dtype=np.int64)
    if np.any(seq_lens > known):
        bad = req_ids[int(np.argmax(seq_lens > known))]
        raise ValueError(f"Request {bad} is scheduled past its known tokens and drafts.")
    query_start = np.concatenate(([0], np.cumsum(query_lens)))
    token_rows = np.repeat(rows, query_lens)  # [T]
    positions = np.repeat(context - query_start[:-1], query_lens) + np.arange(query_start[-1])
    bs = batch.block_size

    # What every KV cache group's metadata shares (the CPU and torch backends), made once.
    shape = None
    if attention_backend != "triton":
        shape = StepShape(
            query_lens=query_lens,
            context_lens=context,
            block_size=bs,
            device=device,
            max_decode_group_tokens=max_decode_group_tokens,
            paged_decodes=attention_backend == "cpu",
            prefill_caps=prefill_caps,
        )

    def metadata(table: np.ndarray, group: int) -> AttentionMetadata | TritonAttentionMetadata:
        slot_mapping = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        if attention_backend == "triton":
            return build_triton_metadata(
                query_lens=query_lens,
                context_lens=context,
                block_table=table[rows],
                slot_mapping=slot_mapping,
                block_size=bs,
                device=device,
                staging=staging,
                staging_prefix=f"group{group}.",
            )
        assert shape is not None
        return shape.metadata(table[rows], slot_mapping)

    groups = tuple(metadata(table, g) for g, table in enumerate(batch.block_tables))
    token_ids = batch.token_ids[token_rows, positions]
    if staging is not None:
        input_ids = staging.to_device("input_ids", token_ids, np.int64)
        positions_tensor = staging.to_device("positions", positions, np.int64)
    else:
        input_ids = torch.from_numpy(token_ids.astype(np.int64)).to(device)
        positions_tensor = torch.from_numpy(positions).to(device)
    return StepInputs(
        req_ids=req_ids,
        input_ids=input_ids,
        positions=positions_tensor,
        attn_metadata=groups[0],
        query_start=query_start,
        context_lens=context,
        samples=seq_lens == known,
        group_metadata=groups if len(groups) > 1 else (),
    )


def sampling_states(step: StepInputs, batch: InputBatch) -> tuple[np.ndarray, list[CachedRequestState]]:
    """The rows of the requests that sample this step, in scheduled order, and their states."""
    rows = np.flatnonzero(step.samples)
    return rows, [batch.requests[step.req_ids[i]] for i in rows]


def record_emitted(
    step: StepInputs,
    batch: InputBatch,
    rows: np.ndarray,
    tokens: list[list[int]],
    entries: list[list[TokenLogprobs]],
) -> tuple[list[list[int]], list[list[TokenLogprobs]]]:
    """Append what each sampling request (``rows``) emitted to ``batch``; per scheduled request,
    its emitted tokens and their logprobs (none where it did not sample)."""
    sampled: list[list[int]] = [[] for _ in step.req_ids]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in step.req_ids]
    for i, row_tokens, row_entries in zip(rows, tokens, entries):
        for token in row_tokens:
            batch.append_token(step.req_ids[i], token)
        sampled[i] = row_tokens
        logprobs[i] = row_entries
    return sampled, logprobs
