"""Per-step attention metadata, built once and shared by every layer.

The step is one flattened batch of ``T`` tokens from ``R`` requests; request
``i`` owns tokens ``[query_start[i], query_start[i] + query_lens[i])`` and has
``context_lens[i]`` tokens already in the KV cache before this step.

Requests split two ways:

- decodes (one new token, some context): attended together. With the
  compiled CPU kernel (``paged_decodes``) in one call per layer that reads
  K/V in place through the block table; otherwise a few SDPA calls per
  layer over K/V gathered block by block into a padded tensor, grouped by
  length to keep the padding small when lengths vary.
- prefills (several new tokens, or no context yet): one SDPA call each,
  causal within the new tokens, over cached context when there is some
  (a later chunk of a chunked prefill, or a prefix-cache hit). With the
  compiled CPU kernels, those within ``PrefillCaps`` (all of them on bf16
  dot products; on the fp32 path all but fresh prompts over 2,048 tokens)
  instead go to one call per layer that reads the context in place
  (``paged_prefills``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# A decode group ends when the next (shorter) sequence would waste more than
# a quarter of its padded row, once the group has _MIN_DECODE_GROUP members:
# each group costs one more gather and SDPA call per layer, worth it only
# when it saves a fair amount of padding. (Decode attention on CPU is bound
# by memory traffic, so padded keys cost as much as real ones.)
_MIN_DECODE_GROUP = 8
_MIN_FILL = 0.75


@dataclass(frozen=True)
class PrefillCaps:
    """The largest prefills, in (query, key) pairs (new tokens x (context + new tokens)), that go
    to the paged CPU kernel: a fresh prompt (no context) or a chunk after cached context; larger
    ones go to SDPA (the step's own K/V, causal; or the context copied out first). None: no cap.
    The kernel reads the context in place and takes every such prefill of the step in one call
    that balances its tiles over the threads."""

    fresh: int | None
    chunk: int | None


# The kernel against SDPA (``python benchmarks/scripts/prefill_kernel_vs_sdpa.py``, 2 threads, SmolLM2's heads,
# 2026-12-02, README "Which prefills go to the kernel"). On bf16 dot products (a bf16 cache on an
# AVX512_BF16 CPU): 2.7-5.3x on every shape measured, fresh prompts of 512-4,096 tokens and chunks
# of 16-2,048 after 1,024-2,048 cached; so no cap. On the fp32 path (fp32, or bf16 elsewhere):
# fresh prompts 1.64-1.82x at 512 tokens, 1.00-1.03x at 2,048, 0.92x at 4,096; chunks 1.15-1.62x
# on every shape (up to 2,048 after 2,048); so fresh prompts up to 2,048 tokens and every chunk.
FP32_PREFILL_CAPS = PrefillCaps(fresh=1 << 22, chunk=None)
BF16_DOT_PREFILL_CAPS = PrefillCaps(fresh=None, chunk=None)
# On the kernel's register tiles, every build's fp32 path since they compute each row as the decode
# kernel does (batch-invariant numerics, kernels/csrc/cpu_paged_attention.cpp): no cap, so that a
# prompt takes the same path whether the scheduler runs it whole or in chunks. On AVX2 (2026-12-06,
# Zen 3, the same script, fp32 and bf16 queries) the tiles beat SDPA anyway: fresh prompts
# 1.09-1.34x at 2,048 tokens, 1.14-1.18x at 4,096, 1.01-1.09x at 8,192; chunks 1.22x at 256 after
# 3,840 and 1.6-2.4x at 16-64 after 448-2,000. (FP32_PREFILL_CAPS is the torch backend's, unused.)
TILE_PREFILL_CAPS = PrefillCaps(fresh=None, chunk=None)


@dataclass(frozen=True)
class DecodeGroup:
    token_idx: torch.Tensor  # [n] long: positions in the flat batch
    block_ids: torch.Tensor  # [n * nb] long: each row's block table, padded with block 0
    mask: torch.Tensor  # [1, n, 1, nb * block_size] bool: True where a key exists
    num_blocks: int  # nb


@dataclass(frozen=True)
class PagedDecodes:
    """Every decode of the step, for ``kernels.cpu_attention.paged_decode_attention``."""

    token_idx: torch.Tensor  # [n] long: positions in the flat batch
    seq_lens: torch.Tensor  # [n] int32: keys per decode, its new token's included
    block_table: torch.Tensor  # [n, max_blocks] int32, rows padded with block 0


@dataclass(frozen=True)
class PagedPrefills:
    """Prefills for ``kernels.cpu_attention.paged_prefill_attention``."""

    query_start: torch.Tensor  # [R] long: first new token of each in the flat batch
    query_lens: torch.Tensor  # [R] int32: its new tokens
    context_lens: torch.Tensor  # [R] int32: tokens cached before this step
    block_table: torch.Tensor  # [R, max_blocks] int32, rows padded with block 0


@dataclass(frozen=True)
class PrefillSeq:
    start: int  # first token in the flat batch
    end: int
    context_len: int
    block_ids: torch.Tensor | None  # [nb] long covering context + new tokens; None without context
    mask: torch.Tensor | None  # [n, context_len + n] bool; None: plain causal


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # [T] long: where each token's K/V is written
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]
    paged_decodes: PagedDecodes | None = None  # instead of decode_groups, with the CPU kernel
    # The sliding-window views of this step by window size (``sliding_window.py``), built on first use.
    windows: dict = field(default_factory=dict, compare=False, repr=False)
    paged_prefills: PagedPrefills | None = None  # short prefills, not in prefills, with the CPU kernel


_UNBOUNDED = np.iinfo(np.int64).max


def _tensor(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (its memory, on the CPU)."""
    t = torch.from_numpy(array)
    return (
        t if device == "cpu" or (isinstance(device, torch.device) and device.type == "cpu") else t.to(device)
    )


def build_attention_metadata(
    *,
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    device: torch.device | str = "cpu",
    max_decode_group_tokens: int | None = None,
    paged_decodes: bool = False,
    prefill_caps: PrefillCaps | None = None,
) -> AttentionMetadata:
    """``block_table`` is ``[R, max_blocks]``, rows padded with block 0 (the null block).

    ``max_decode_group_tokens`` caps one decode group's padded keys (rows x
    padded length), and so the size of the gather buffer; a sequence longer
    than the cap still gets a group of its own. ``paged_decodes`` describes
    the decodes for the CPU kernel instead of grouping them, and the prefills
    within ``prefill_caps`` (``FP32_PREFILL_CAPS`` when None) for its prefill kernel.
    """
    step = StepShape(
        query_lens=query_lens,
        context_lens=context_lens,
        block_size=block_size,
        device=device,
        max_decode_group_tokens=max_decode_group_tokens,
        paged_decodes=paged_decodes,
        prefill_caps=prefill_caps,
    )
    return step.metadata(block_table, slot_mapping)


class StepShape:
    """What a step's attention metadata takes from its requests' lengths alone: which rows are
    decodes and which prefills go to which kernel, and the tensors of lengths and starts. A model
    with several KV cache groups (Gemma 3's window layers) builds it once a step and each group's
    metadata from it (``metadata``), on its own block table and slots; the arguments are
    ``build_attention_metadata``'s."""

    def __init__(
        self,
        *,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_size: int,
        device: torch.device | str = "cpu",
        max_decode_group_tokens: int | None = None,
        paged_decodes: bool = False,
        prefill_caps: PrefillCaps | None = None,
    ) -> None:
        self.block_size, self.device, self.paged = block_size, device, paged_decodes
        self.query_lens = query_lens = np.asarray(query_lens, dtype=np.int64)
        self.context_lens = context_lens = np.asarray(context_lens, dtype=np.int64)
        self.query_start = query_start = np.concatenate(([0], np.cumsum(query_lens)))
        self.seq_lens = seq_lens = context_lens + query_lens
        is_decode = (query_lens == 1) & (context_lens > 0)
        self.decode_idx = decode_idx = np.flatnonzero(is_decode)
        self.decode_split = (
            []
            if paged_decodes
            else _split_by_length(decode_idx, seq_lens, block_size, max_decode_group_tokens)
        )
        prefill_idx = np.flatnonzero(~is_decode)
        short = long = prefill_idx
        if prefill_idx.size and paged_decodes:
            pairs = query_lens[prefill_idx] * seq_lens[prefill_idx]
            caps = prefill_caps or FP32_PREFILL_CAPS
            fresh, chunk = (_UNBOUNDED if c is None else c for c in (caps.fresh, caps.chunk))
            within = pairs <= np.where(context_lens[prefill_idx] == 0, fresh, chunk)
            short, long = prefill_idx[within], prefill_idx[~within]
        elif not paged_decodes:
            short = prefill_idx[:0]
        self.short, self.long = short, long
        # The paged kernels' lengths and starts, the same for every group.
        self._decodes: tuple[int, torch.Tensor, torch.Tensor] | None = None
        if paged_decodes and decode_idx.size:
            lens = seq_lens[decode_idx]
            self._decodes = (
                int(-(-lens.max() // block_size)),
                _tensor(query_start[decode_idx], device),
                _tensor(lens.astype(np.int32), device),
            )
        self._prefills: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if short.size:
            self._prefills = (
                int(-(-(context_lens[short] + query_lens[short]).max() // block_size)),
                _tensor(query_start[short], device),
                _tensor(query_lens[short].astype(np.int32), device),
                _tensor(context_lens[short].astype(np.int32), device),
            )

    def metadata(self, block_table: np.ndarray, slot_mapping: np.ndarray) -> AttentionMetadata:
        """The metadata of the group whose block table (``[R, max_blocks]``) and slots these are."""
        bs, device = self.block_size, self.device
        paged = paged_prefills = None
        if self._decodes is not None:
            nb, token_idx, seq_lens = self._decodes
            rows = self.decode_idx
            paged = PagedDecodes(token_idx, seq_lens, _tensor(_table_rows(block_table, rows, nb), device))
        if self._prefills is not None:
            nb, query_start, query_lens, context_lens = self._prefills
            table = _tensor(_table_rows(block_table, self.short, nb), device)
            paged_prefills = PagedPrefills(query_start, query_lens, context_lens, table)
        args = (self.query_start, self.seq_lens, block_table, bs, device)
        return AttentionMetadata(
            num_tokens=int(self.query_start[-1]),
            block_size=bs,
            slot_mapping=_tensor(np.asarray(slot_mapping, dtype=np.int64), device),
            decode_groups=[_decode_group(rows, *args) for rows in self.decode_split],
            prefills=[
                _prefill_seq(
                    int(i), self.query_start, self.context_lens, self.seq_lens, block_table, bs, device
                )
                for i in self.long
            ],
            paged_decodes=paged,
            paged_prefills=paged_prefills,
        )


def _table_rows(block_table: np.ndarray, rows: np.ndarray, nb: int) -> np.ndarray:
    return np.ascontiguousarray(block_table[rows, :nb], dtype=np.int32)


def _split_by_length(
    decode_idx: np.ndarray, seq_lens: np.ndarray, block_size: int, max_tokens: int | None
) -> list[np.ndarray]:
    """Decode rows, longest first, cut into groups padded to their first (longest) member."""
    if decode_idx.size == 0:
        return []
    blocks = -(-seq_lens[decode_idx] // block_size)
    order = np.argsort(-blocks, kind="stable")
    groups, first = [], 0
    for j in range(1, order.size):
        size, longest = j - first, blocks[order[first]]
        too_sparse = size >= _MIN_DECODE_GROUP and blocks[order[j]] < _MIN_FILL * longest
        too_big = max_tokens is not None and (size + 1) * longest * block_size > max_tokens
        if too_sparse or too_big:
            groups.append(decode_idx[order[first:j]])
            first = j
    groups.append(decode_idx[order[first:]])
    return groups


def _decode_group(rows, query_start, seq_lens, block_table, block_size, device) -> DecodeGroup:
    lens = seq_lens[rows]
    nb = int(-(-lens.max() // block_size))
    mask = np.arange(nb * block_size)[None, :] < lens[:, None]  # [n, nb * bs]
    return DecodeGroup(
        token_idx=_tensor(query_start[rows], device),
        block_ids=_tensor(block_table[rows, :nb].astype(np.int64).reshape(-1), device),
        mask=_tensor(mask[None, :, None, :], device),
        num_blocks=nb,
    )


def _prefill_seq(i, query_start, context_lens, seq_lens, block_table, block_size, device) -> PrefillSeq:
    start, end, context = int(query_start[i]), int(query_start[i + 1]), int(context_lens[i])
    if context == 0:
        return PrefillSeq(start, end, 0, None, None)
    seq_len = int(seq_lens[i])
    nb = -(-seq_len // block_size)
    # Query j sits at absolute position context + j and sees keys 0..context + j.
    key_pos = np.arange(seq_len)[None, :]
    query_pos = context + np.arange(end - start)[:, None]
    return PrefillSeq(
        start,
        end,
        context,
        block_ids=_tensor(block_table[i, :nb].astype(np.int64), device),
        mask=_tensor(key_pos <= query_pos, device),
    )
