"""Which prefills the cpu backend sends to the paged prefill kernel, and a step of SmolLM2-sized
mid-length prompts, chunks and decodes through the attention layer against dense attention,
fp32 and bf16."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from services.worker.forward_context import set_forward_context
from services.worker.layers.attention import PagedAttention, kv_cache_shape, write_kv
from services.worker.layers.attention_metadata import (
    PAGED_CHUNK_MAX_PAIRS,
    PAGED_PREFILL_MAX_PAIRS,
    build_attention_metadata,
)

H, KVH, D, BS = 9, 3, 64, 16

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)


def metadata(shapes, paged=True):
    query_lens = np.array([n for _, n in shapes])
    return build_attention_metadata(
        query_lens=query_lens,
        context_lens=np.array([c for c, _ in shapes]),
        block_table=np.zeros((len(shapes), 256), dtype=np.int32),
        slot_mapping=np.zeros(int(query_lens.sum())),
        block_size=BS,
        paged_decodes=paged,
    )


def test_prefills_up_to_the_pair_caps_go_to_the_kernel_larger_ones_to_sdpa():
    # (context, new): pairs = new x (context + new); fresh prompts and chunks have their own caps.
    shapes = [(0, 1024), (0, 1448), (0, 1449), (2000, 16), (1984, 64), (0, 2048), (240, 16), (40, 1)]
    assert 1448 * 1448 <= PAGED_PREFILL_MAX_PAIRS < 1449 * 1449
    assert 16 * 2016 <= PAGED_CHUNK_MAX_PAIRS < 64 * 2048
    meta = metadata(shapes)
    assert meta.paged_prefills.query_lens.tolist() == [1024, 1448, 16, 16]
    assert meta.paged_prefills.context_lens.tolist() == [0, 0, 2000, 240]
    assert [(p.context_len, p.end - p.start) for p in meta.prefills] == [(0, 1449), (1984, 64), (0, 2048)]
    assert meta.paged_decodes.seq_lens.tolist() == [41]
    # The torch backend runs every prefill through SDPA.
    assert metadata(shapes, paged=False).paged_prefills is None


def dense(queries, keys, values, context):
    """[n, H, D] fp32: queries at positions context.. attend causally over keys [S, KVH, D]."""
    k = keys.float().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    v = values.float().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    scores = queries.float().transpose(0, 1) @ k.transpose(1, 2) / D**0.5  # [H, n, S]
    query_pos = torch.arange(context, context + queries.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > query_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@needs_compiler
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_mid_length_prompts_matches_dense_attention(backend, dtype):
    """Fresh prompts of 32-512 tokens as offline-64 brings them, chunks over cached context and
    decodes in one step: the kernels (cpu backend; its largest chunk on SDPA) and SDPA (torch)
    both give dense attention."""
    gen = torch.Generator().manual_seed(4)
    shapes = [(0, 512), (0, 37), (200, 1), (0, 300), (256, 130), (90, 1), (600, 120)]  # the last: SDPA
    blocks = (torch.randperm(200, generator=gen) + 1).tolist()
    cache = torch.zeros(kv_cache_shape(201, BS, KVH, D), dtype=dtype)
    table = np.zeros((len(shapes), 64), dtype=np.int32)
    seqs, slot_mapping = [], []
    for i, (context, new) in enumerate(shapes):
        table[i, : -(-(context + new) // BS)] = [blocks.pop() for _ in range(-(-(context + new) // BS))]
        keys = torch.randn(context + new, KVH, D, generator=gen).to(dtype)
        values = torch.randn(context + new, KVH, D, generator=gen).to(dtype)
        slots = torch.tensor([int(table[i, p // BS]) * BS + p % BS for p in range(context + new)])
        write_kv(cache, keys[:context], values[:context], slots[:context])
        slot_mapping.append(slots[context:])
        seqs.append((context, keys, values, torch.randn(new, H, D, generator=gen).to(dtype)))
    meta = build_attention_metadata(
        query_lens=np.array([n for _, n in shapes]),
        context_lens=np.array([c for c, _ in shapes]),
        block_table=table,
        slot_mapping=torch.cat(slot_mapping).numpy(),
        block_size=BS,
        paged_decodes=backend == "cpu",
    )
    if backend == "cpu":
        assert [p.end - p.start for p in meta.prefills] == [120]
    q = torch.cat([s[3] for s in seqs]).reshape(-1, H * D)
    k = torch.cat([s[1][s[0] :] for s in seqs]).reshape(-1, KVH * D)
    v = torch.cat([s[2][s[0] :] for s in seqs]).reshape(-1, KVH * D)
    layer = PagedAttention(layer_idx=0, num_heads=H, num_kv_heads=KVH, head_dim=D)
    with set_forward_context(meta, [cache], backend):
        out = layer(q, k, v).view(-1, H, D)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for i, (context, keys, values, queries) in enumerate(seqs):
        want = dense(queries, keys, values, context)
        got = out[start : start + queries.shape[0]].float()
        assert (got - want).abs().max().item() <= tolerance, f"sequence {i}"
        start += queries.shape[0]
