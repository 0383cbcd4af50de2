"""Paged attention (torch and cpu backends) against dense causal attention per sequence."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from services.worker.forward_context import get_forward_context, set_forward_context
from services.worker.layers import attention_metadata
from services.worker.layers.attention import PagedAttention, kv_cache_shape, write_kv
from services.worker.layers.attention_metadata import build_attention_metadata

H, KVH, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 64

# The cpu backend's kernel is built with the machine's compiler (weft falls back to torch without one).
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)


@dataclass
class Seq:
    blocks: list[int]
    context: int  # tokens already cached
    new: int  # tokens this step
    keys: torch.Tensor  # [context + new, KVH, D], the whole sequence
    values: torch.Tensor
    queries: torch.Tensor  # [new, H, D]


def make_seq(gen, blocks, context, new, prefix: Seq | None = None) -> Seq:
    total = context + new
    keys, values = torch.randn(total, KVH, D, generator=gen), torch.randn(total, KVH, D, generator=gen)
    if prefix is not None:  # a prefix-cache hit: same tokens, so the same K/V in the shared blocks
        shared = min(total, prefix.keys.shape[0], context)
        keys[:shared], values[:shared] = prefix.keys[:shared], prefix.values[:shared]
    return Seq(blocks, context, new, keys, values, torch.randn(new, H, D, generator=gen))


def slots(seq: Seq, positions) -> torch.Tensor:
    return torch.tensor([seq.blocks[p // BS] * BS + p % BS for p in positions])


def dense_reference(seq: Seq) -> torch.Tensor:
    """[new, H, D]: queries at positions context.. attend causally over the whole sequence."""
    k = seq.keys.repeat_interleave(H // KVH, dim=1).transpose(0, 1)  # [H, S, D]
    v = seq.values.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    q = seq.queries.transpose(0, 1)  # [H, n, D]
    scores = q @ k.transpose(1, 2) / D**0.5  # [H, n, S]
    query_pos = torch.arange(seq.context, seq.context + seq.new)[:, None]
    scores = scores.masked_fill(torch.arange(seq.keys.shape[0])[None, :] > query_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def run_step(
    seqs: list[Seq],
    cache: torch.Tensor | None,
    max_decode_group_tokens: int | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Cache every sequence's context, then run one flattened step; returns [T, H, D].
    ``backend`` "cpu" sends the decodes to the compiled kernel."""
    if cache is not None:
        for s in seqs:
            if s.context:
                write_kv(cache, s.keys[: s.context], s.values[: s.context], slots(s, range(s.context)))
    max_blocks = max(len(s.blocks) for s in seqs)
    table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s.blocks)] = s.blocks
    slot_mapping = torch.cat([slots(s, range(s.context, s.context + s.new)) for s in seqs])
    meta = build_attention_metadata(
        query_lens=np.array([s.new for s in seqs]),
        context_lens=np.array([s.context for s in seqs]),
        block_table=table,
        slot_mapping=slot_mapping.numpy(),
        block_size=BS,
        max_decode_group_tokens=max_decode_group_tokens,
        paged_decodes=backend == "cpu",
    )
    q = torch.cat([s.queries for s in seqs]).reshape(-1, H * D)
    k = torch.cat([s.keys[s.context :] for s in seqs]).reshape(-1, KVH * D)
    v = torch.cat([s.values[s.context :] for s in seqs]).reshape(-1, KVH * D)
    layer = PagedAttention(layer_idx=0, num_heads=H, num_kv_heads=KVH, head_dim=D)
    with set_forward_context(meta, None if cache is None else [cache], backend):
        return layer(q, k, v).view(-1, H, D)


def assert_matches_reference(seqs: list[Seq], out: torch.Tensor) -> None:
    start = 0
    for i, s in enumerate(seqs):
        torch.testing.assert_close(
            out[start : start + s.new], dense_reference(s), atol=1e-5, rtol=1e-5, msg=f"sequence {i}"
        )
        start += s.new


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_compiler)])
def test_mixed_batch_of_prefills_chunks_decodes_and_a_prefix_hit(backend):
    gen = torch.Generator().manual_seed(0)
    chunked = make_seq(gen, [5, 9, 3], context=6, new=3)  # a later chunk of a chunked prefill
    seqs = [
        make_seq(gen, [11, 12, 13], context=9, new=1),  # decode
        make_seq(gen, [1, 2], context=0, new=5),  # first prefill chunk
        chunked,
        make_seq(gen, [20], context=2, new=1),  # short decode
        # Prefix hit: its first two (full) blocks are the chunked request's.
        make_seq(gen, [5, 9, 30], context=8, new=4, prefix=chunked),
    ]
    cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BS, KVH, D))
    assert_matches_reference(seqs, run_step(seqs, cache, backend=backend))


def test_new_tokens_are_written_to_their_slots():
    gen = torch.Generator().manual_seed(1)
    seqs = [make_seq(gen, [7, 8], context=3, new=2), make_seq(gen, [4], context=0, new=3)]
    cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BS, KVH, D))
    run_step(seqs, cache)
    rows = cache.view(2, KVH, NUM_BLOCKS * BS, D)
    for s in seqs:
        written = slots(s, range(s.context + s.new))
        torch.testing.assert_close(rows[0][:, written].transpose(0, 1), s.keys)
        torch.testing.assert_close(rows[1][:, written].transpose(0, 1), s.values)


@pytest.mark.parametrize("max_group_tokens", [None, 100])
def test_many_decodes_of_very_different_lengths(max_group_tokens):
    """Enough decodes, spread widely, that they are split into several padded groups."""
    gen = torch.Generator().manual_seed(2)
    seqs, next_block = [], 1
    for length in [
        1,
        2,
        3,
        5,
        8,
        13,
        21,
        34,
        55,
        60,
        61,
        62,
        40,
        41,
        42,
        43,
        44,
        45,
        46,
        47,
        3,
        4,
        5,
        6,
        7,
        9,
        10,
    ]:
        n_blocks = -(-(length + 1) // BS)
        blocks = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        seqs.append(make_seq(gen, blocks, context=length, new=1))
    cache = torch.zeros(kv_cache_shape(next_block, BS, KVH, D))
    meta_groups = build_attention_metadata(
        query_lens=np.ones(len(seqs)),
        context_lens=np.array([s.context for s in seqs]),
        block_table=np.zeros((len(seqs), 16), dtype=np.int32),
        slot_mapping=np.zeros(len(seqs)),
        block_size=BS,
        max_decode_group_tokens=max_group_tokens,
    ).decode_groups
    assert len(meta_groups) > 1
    if max_group_tokens is not None:  # only a sequence longer than the cap may exceed it, alone
        assert all(g.block_ids.numel() * BS <= max_group_tokens or len(g.token_idx) == 1 for g in meta_groups)
    assert_matches_reference(seqs, run_step(seqs, cache, max_group_tokens))


@needs_compiler
def test_cpu_backend_takes_every_decode_in_one_kernel_call():
    """Decodes of very different lengths over blocks out of order, mixed with a prefill: one
    PagedDecodes with each decode's own length, no groups, no padding."""
    gen = torch.Generator().manual_seed(4)
    pool = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    seqs = []
    for context, new in [(1, 1), (3, 1), (4, 1), (17, 1), (0, 6), (40, 1), (7, 1), (8, 1)]:
        seqs.append(make_seq(gen, [pool.pop() for _ in range(-(-(context + new) // BS))], context, new))
    cache = torch.full(
        kv_cache_shape(NUM_BLOCKS, BS, KVH, D), float("nan")
    )  # unwritten slots must never be read
    meta = build_attention_metadata(
        query_lens=np.array([s.new for s in seqs]),
        context_lens=np.array([s.context for s in seqs]),
        block_table=np.zeros((len(seqs), 11), dtype=np.int32),
        slot_mapping=np.zeros(sum(s.new for s in seqs)),
        block_size=BS,
        paged_decodes=True,
    )
    assert meta.decode_groups == [] and meta.prefills == []  # a short prefill goes to the prefill kernel
    assert meta.paged_prefills.query_lens.tolist() == [6]
    assert meta.paged_decodes.seq_lens.tolist() == [s.context + 1 for s in seqs if s.new == 1]
    assert_matches_reference(seqs, run_step(seqs, cache, backend="cpu"))


@needs_compiler
def test_cpu_backend_sends_small_prefills_to_the_kernel_and_large_ones_to_sdpa(monkeypatch):
    """Prefills within the caps, in (query, key) pairs (a verify-sized chunk over context, a short
    prompt), go to the paged prefill kernel; larger ones stay on SDPA. Both match dense attention."""
    monkeypatch.setattr(attention_metadata, "FP32_PREFILL_CAPS", attention_metadata.PrefillCaps(200, 200))
    gen = torch.Generator().manual_seed(5)
    shapes = [(30, 5), (0, 9), (0, 15), (6, 12), (12, 1)]  # pairs 175, 81, 225, 216; a decode
    pool = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    seqs = [make_seq(gen, [pool.pop() for _ in range(-(-(c + n) // BS))], c, n) for c, n in shapes]
    meta = build_attention_metadata(
        query_lens=np.array([s.new for s in seqs]),
        context_lens=np.array([s.context for s in seqs]),
        block_table=np.zeros((len(seqs), 20), dtype=np.int32),
        slot_mapping=np.zeros(sum(s.new for s in seqs)),
        block_size=BS,
        paged_decodes=True,
    )
    assert meta.paged_prefills.query_lens.tolist() == [5, 9]
    assert [p.end - p.start for p in meta.prefills] == [15, 12]
    cache = torch.full(kv_cache_shape(NUM_BLOCKS, BS, KVH, D), float("nan"))
    assert_matches_reference(seqs, run_step(seqs, cache, backend="cpu"))


def test_profiling_step_runs_without_a_cache():
    gen = torch.Generator().manual_seed(3)
    seqs = [make_seq(gen, [0] * 4, context=0, new=13), make_seq(gen, [0], context=0, new=1)]
    assert_matches_reference(seqs, run_step(seqs, cache=None))


def test_forward_context_is_scoped_to_its_block():
    meta = build_attention_metadata(
        query_lens=np.array([1]),
        context_lens=np.array([0]),
        block_table=np.zeros((1, 1), np.int32),
        slot_mapping=np.zeros(1),
        block_size=BS,
    )
    with set_forward_context(meta, None):
        assert get_forward_context().attn_metadata is meta
    with pytest.raises(RuntimeError, match="forward context"):
        get_forward_context()


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_compiler)])
def test_an_int8_cache_through_either_backend(backend):
    """The same mixed step over an int8 cache (``--kv-cache-dtype int8``): the cpu backend writes the
    new tokens with the compiled op and its kernels read the cache in place; the torch backend
    writes with the twin's torch ops and its gathers dequantize. Both equal dense attention over
    the rounded keys and values."""
    from kernels.reference import quantize_kv_rows_ref, write_kv_int8_ref

    gen = torch.Generator().manual_seed(5)
    chunked = make_seq(gen, [5, 9, 3], context=6, new=3)
    seqs = [
        make_seq(gen, [11, 12, 13], context=9, new=1),
        make_seq(gen, [1, 2], context=0, new=5),
        chunked,
        make_seq(gen, [20], context=2, new=1),
    ]
    cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BS, KVH, D), dtype=torch.int8)
    scales = torch.zeros(cache.shape[:-1])
    for s in seqs:
        if s.context:
            context = range(s.context)
            write_kv_int8_ref(s.keys[: s.context], s.values[: s.context], cache, scales, slots(s, context))
    max_blocks = max(len(s.blocks) for s in seqs)
    table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s.blocks)] = s.blocks
    meta = build_attention_metadata(
        query_lens=np.array([s.new for s in seqs]),
        context_lens=np.array([s.context for s in seqs]),
        block_table=table,
        slot_mapping=torch.cat([slots(s, range(s.context, s.context + s.new)) for s in seqs]).numpy(),
        block_size=BS,
        paged_decodes=backend == "cpu",  # and the prefills within the caps (all of these)
    )
    q = torch.cat([s.queries for s in seqs]).reshape(-1, H * D)
    k = torch.cat([s.keys[s.context :] for s in seqs]).reshape(-1, KVH * D)
    v = torch.cat([s.values[s.context :] for s in seqs]).reshape(-1, KVH * D)
    layer = PagedAttention(layer_idx=0, num_heads=H, num_kv_heads=KVH, head_dim=D)
    with set_forward_context(meta, [cache], backend, kv_scales=[scales]):
        out = layer(q, k, v).view(-1, H, D)
    for s in seqs:  # what the cache holds: each row rounded to int8 against its own scale
        if backend == "torch" and s.context == 0:
            continue  # the torch backend's fresh prompt attends over its own K/V, not the cache
        for name in ("keys", "values"):
            rows, row_scales = quantize_kv_rows_ref(getattr(s, name))
            setattr(s, name, rows.float() * row_scales[..., None])
    assert_matches_reference(seqs, out)
