"""Which prefills the cpu backend sends to the paged prefill kernel, and a step of SmolLM2-sized
mid-length prompts, chunks and decodes through the attention layer against dense attention,
fp32 and bf16."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch

from services.worker.forward_context import set_forward_context
from services.worker.layers.attention import PagedAttention, kv_cache_shape, write_kv
from services.worker.layers.attention_metadata import (
    BF16_DOT_PREFILL_CAPS,
    FP32_PREFILL_CAPS,
    TILE_PREFILL_CAPS,
    PrefillCaps,
    build_attention_metadata,
)
from services.worker.model_runner import prefill_caps_for

H, KVH, D, BS = 9, 3, 64, 16

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)


def metadata(shapes, paged=True, caps=None):
    query_lens = np.array([n for _, n in shapes])
    return build_attention_metadata(
        query_lens=query_lens,
        context_lens=np.array([c for c, _ in shapes]),
        block_table=np.zeros((len(shapes), 512), dtype=np.int32),
        slot_mapping=np.zeros(int(query_lens.sum())),
        block_size=BS,
        paged_decodes=paged,
        prefill_caps=caps,
    )


# (context, new): pairs = new x (context + new).
SHAPES = [
    (0, 1024),
    (0, 2048),
    (0, 2049),
    (2000, 16),
    (1984, 64),
    (2048, 2048),
    (0, 4096),
    (240, 16),
    (40, 1),
]


def test_on_the_fp32_path_fresh_prompts_over_2048_tokens_go_to_sdpa_and_every_chunk_to_the_kernel():
    assert FP32_PREFILL_CAPS.fresh == 2048 * 2048 and FP32_PREFILL_CAPS.chunk is None
    meta = metadata(SHAPES)  # the default caps: the fp32 path's
    assert meta.paged_prefills.query_lens.tolist() == [1024, 2048, 16, 64, 2048, 16]
    assert meta.paged_prefills.context_lens.tolist() == [0, 0, 2000, 1984, 2048, 240]
    assert [(p.context_len, p.end - p.start) for p in meta.prefills] == [(0, 2049), (0, 4096)]
    assert meta.paged_decodes.seq_lens.tolist() == [41]
    # The torch backend runs every prefill through SDPA.
    assert metadata(SHAPES, paged=False).paged_prefills is None


def test_on_bf16_dot_products_every_prefill_goes_to_the_kernel():
    meta = metadata(SHAPES, caps=BF16_DOT_PREFILL_CAPS)
    assert meta.prefills == [] and meta.paged_prefills.query_lens.tolist() == [
        1024,
        2048,
        2049,
        16,
        64,
        2048,
        4096,
        16,
    ]


def test_the_caps_follow_the_path_the_kernel_takes(monkeypatch):
    from kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "amx_isa", lambda: ("avx512bf16", []))
    # The bf16 dot products are opt-in (not batch-invariant): unset, every prefill on the tiles.
    monkeypatch.delenv("WEFT_ATTENTION_BF16_DOT", raising=False)
    assert prefill_caps_for("cpu", torch.bfloat16, 64) is TILE_PREFILL_CAPS
    monkeypatch.setenv("WEFT_ATTENTION_BF16_DOT", "1")
    assert prefill_caps_for("cpu", torch.bfloat16, 64) is BF16_DOT_PREFILL_CAPS
    assert prefill_caps_for("cpu", torch.bfloat16, 96) is TILE_PREFILL_CAPS  # no bf16 dots for that head size
    assert prefill_caps_for("cpu", torch.float32, 64) is TILE_PREFILL_CAPS
    assert prefill_caps_for("torch", torch.bfloat16, 64) is FP32_PREFILL_CAPS  # unused there: no kernel
    monkeypatch.setattr(cpu_attention, "amx_isa", lambda: ("amxbf16", []))  # AMX tiles: the bf16 path too
    assert prefill_caps_for("cpu", torch.bfloat16, 64) is BF16_DOT_PREFILL_CAPS
    monkeypatch.setattr(cpu_attention, "amx_isa", lambda: ("avx512", []))
    assert prefill_caps_for("cpu", torch.bfloat16, 64) is TILE_PREFILL_CAPS
    monkeypatch.setenv("WEFT_ATTENTION_BF16_DOT", "0")
    # Every build: every prefill on the register tiles, whatever the dtype (and none on the torch backend).
    for isa in ("avx2", "avx512", "avx512bf16"):
        monkeypatch.setattr(cpu_attention, "amx_isa", lambda isa=isa: (isa, []))
        for dtype in (torch.float32, torch.bfloat16):
            assert prefill_caps_for("cpu", dtype, 64) is TILE_PREFILL_CAPS
    assert TILE_PREFILL_CAPS.fresh is None and TILE_PREFILL_CAPS.chunk is None
    assert prefill_caps_for("torch", torch.float32, 64) is FP32_PREFILL_CAPS


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
    decodes in one step: the kernels (cpu backend; its largest chunk on SDPA, by a chunk cap set
    for the test) and SDPA (torch) both give dense attention."""
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
        prefill_caps=PrefillCaps(fresh=None, chunk=64_000),  # 130 x 386 pairs in, 120 x 720 not
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


def _same_tensors(a, b) -> bool:
    return type(a) is type(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))
    )


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_each_groups_metadata_from_one_step_shape_is_what_its_own_build_gives(paged, seed):
    """Gemma 3's KV cache groups take their metadata from one ``StepShape`` a step: for a random step
    of decodes, short and long prefills, each group's equals ``build_attention_metadata`` on its own
    block table and slots."""
    from services.worker.layers.attention_metadata import StepShape

    rng = np.random.default_rng(seed)
    n, bs = 9, 16
    query_lens = rng.choice([1, 1, 1, 5, 40, 300], size=n)
    context_lens = rng.integers(0, 200, size=n) * rng.integers(0, 2, size=n)
    caps = PrefillCaps(fresh=2000, chunk=4000)
    shape = StepShape(
        query_lens=query_lens,
        context_lens=context_lens,
        block_size=bs,
        paged_decodes=paged,
        prefill_caps=caps,
    )
    for _ in range(3):  # three groups: their own block tables and slots
        table = rng.integers(1, 500, size=(n, 40)).astype(np.int32)
        slots = rng.integers(0, 500 * bs, size=int(query_lens.sum()))
        shared = shape.metadata(table, slots)
        alone = build_attention_metadata(
            query_lens=query_lens,
            context_lens=context_lens,
            block_table=table,
            slot_mapping=slots,
            block_size=bs,
            paged_decodes=paged,
            prefill_caps=caps,
        )
        assert shared.num_tokens == alone.num_tokens and torch.equal(shared.slot_mapping, alone.slot_mapping)
        for a, b in (
            (shared.paged_decodes, alone.paged_decodes),
            (shared.paged_prefills, alone.paged_prefills),
        ):
            assert (a is None) == (b is None) and (a is None or _same_tensors(a, b))
        assert len(shared.prefills) == len(alone.prefills) and len(shared.decode_groups) == len(
            alone.decode_groups
        )
        assert all(_same_tensors(a, b) for a, b in zip(shared.prefills, alone.prefills))
        assert all(_same_tensors(a, b) for a, b in zip(shared.decode_groups, alone.decode_groups))
        # Each group's block tables are its own.
        if shared.paged_decodes is not None:
            rows = np.flatnonzero((query_lens == 1) & (context_lens > 0))
            nb = shared.paged_decodes.block_table.shape[1]
            assert np.array_equal(shared.paged_decodes.block_table.numpy(), table[rows, :nb])
