"""The paged attention kernel against its torch twin on small mixed batches."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from kernels import interpreting
from kernels.paged_attention import paged_attention
from kernels.reference import paged_attention_ref

NUM_KV_HEADS = 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@dataclass(frozen=True)
class Req:
    context: int  # tokens already in the cache
    new: int  # this step's queries (their K/V are written before attention runs)
    # A prefix-cache hit: this request's context starts with the full blocks of that earlier request.
    shares_prefix_of: int | None = None


# Every shape a step can mix: a fresh prefill, decodes, a later chunk of a
# chunked prefill (context not block-aligned), speculative verification
# (a few queries after a context), a one-token prompt, and a prefix-cache hit
# whose queries start mid-context in blocks another request owns.
MIXED = [
    Req(context=0, new=23),
    Req(context=40, new=1),
    Req(context=37, new=16),
    Req(context=50, new=4),
    Req(context=0, new=1),
    Req(context=40, new=6, shares_prefix_of=1),
]


def make_batch(reqs, *, num_heads, head_dim, block_size, dtype, gen, pool_blocks=64):
    """Random queries, a cache whose unused slots hold NaN, and block tables drawn out of order from the pool."""
    order = (torch.randperm(pool_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    cache = torch.full((2, NUM_KV_HEADS, pool_blocks, block_size, head_dim), float("nan"), dtype=dtype)
    tables, seq_lens = [], []
    for req in reqs:
        seq_len = req.context + req.new
        shared = []
        if req.shares_prefix_of is not None:  # only full blocks are shared
            shared = tables[req.shares_prefix_of][
                : min(seq_lens[req.shares_prefix_of], req.context) // block_size
            ]
        blocks = shared + [order.pop() for _ in range(-(-seq_len // block_size) - len(shared))]
        tables.append(blocks)
        seq_lens.append(seq_len)
        for pos in range(len(shared) * block_size, seq_len):
            cache[:, :, blocks[pos // block_size], pos % block_size] = torch.randn(
                2, NUM_KV_HEADS, head_dim, generator=gen
            ).to(dtype)
    width = max(len(t) for t in tables) + 1  # a spare column: rows are padded with the null block
    block_table = torch.zeros(len(reqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = torch.tensor(t)
    query_lens = torch.tensor([r.new for r in reqs])
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]).int()
    query = torch.randn(int(query_lens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    return dict(
        query=query,
        kv_cache=cache,
        query_start_loc=query_start,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        scale=head_dim**-0.5,
        max_query_len=int(query_lens.max()),
    )


def run_both(batch, device, **kernel_kwargs):
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return paged_attention(**on_device, **kernel_kwargs), paged_attention_ref(**batch)


# (gqa, block_size, head_dim, dtype): every combination on a GPU. Under Triton's interpreter (CPU,
# seconds a case) the 9 of the 36 where each value of a parameter meets each value of every other.
f32, f16, bf16 = DTYPES
MIXED_CASES = (
    list(itertools.product([1, 3, 8], [16, 32], [64, 128], DTYPES))
    if not interpreting()
    else [
        (1, 16, 64, f32),
        (1, 16, 64, f16),
        (1, 32, 128, bf16),
        (3, 16, 64, f32),
        (3, 16, 128, f16),
        (3, 32, 64, bf16),
        (8, 32, 128, f32),
        (8, 32, 64, f16),
        (8, 16, 64, bf16),
    ]
)


@pytest.mark.parametrize("gqa, block_size, head_dim, dtype", MIXED_CASES, ids=str)
def test_mixed_batch_matches_twin(gqa, block_size, head_dim, dtype, device, generator, close):
    batch = make_batch(
        MIXED,
        num_heads=NUM_KV_HEADS * gqa,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        gen=generator,
    )
    out, expected = run_both(batch, device)
    assert torch.isfinite(out).all()  # the NaN in unused slots never leaks in
    close(out, expected, dtype)


def test_prefix_hit_reads_the_shared_blocks(device, generator, close):
    """Two requests over the same leading blocks: the second's queries start mid-context, in blocks it does not own."""
    reqs = [Req(context=0, new=48), Req(context=35, new=7, shares_prefix_of=0)]
    batch = make_batch(reqs, num_heads=6, head_dim=64, block_size=16, dtype=torch.float32, gen=generator)
    assert batch["block_table"][1, :2].tolist() == batch["block_table"][0, :2].tolist()
    out, expected = run_both(batch, device)
    close(out, expected, torch.float32)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_decode_split_over_keys(num_kv_splits, dtype, device, generator, close):
    """Decodes over contexts of many out-of-order blocks, with the keys split over programs and merged."""
    reqs = [Req(context=300, new=1), Req(context=5, new=1), Req(context=129, new=1)]
    batch = make_batch(reqs, num_heads=16, head_dim=128, block_size=16, dtype=dtype, gen=generator)
    assert batch["max_query_len"] == 1
    out, expected = run_both(batch, device, num_kv_splits=num_kv_splits)
    close(out, expected, dtype)


def test_writes_into_out_and_handles_an_empty_batch(device, generator, close):
    batch = make_batch(
        [Req(context=10, new=3)], num_heads=4, head_dim=64, block_size=16, dtype=torch.float32, gen=generator
    )
    out = torch.empty_like(batch["query"]).to(device)
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    assert paged_attention(**on_device, out=out) is out
    close(out, paged_attention_ref(**batch), torch.float32)
    empty = {
        **on_device,
        "query": on_device["query"][:0],
        "query_start_loc": torch.zeros(2, dtype=torch.int32, device=device),
    }
    assert paged_attention(**empty).shape == (0, 4, 64)


def test_refuses_bad_arguments(generator):
    batch = make_batch(
        [Req(context=10, new=3)], num_heads=4, head_dim=64, block_size=16, dtype=torch.float32, gen=generator
    )
    with pytest.raises(ValueError, match="int32"):
        paged_attention(**{**batch, "seq_lens": batch["seq_lens"].long()})
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(**{**batch, "query": torch.randn(3, 3, 64)})
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_ref(**{**batch, "query": batch["query"].half()})


@pytest.mark.parametrize("window", [0, 5, 20])
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_mixed_step_splits_its_decodes_and_keeps_a_window(window, num_kv_splits, device, generator, close):
    """Decode rows of a mixed step split over their keys, the other rows whole; a sliding window
    (shorter and longer than a block) hides the keys before it, and the NaN slots past the cache's
    written keys stay unread."""
    batch = make_batch(MIXED, num_heads=4, head_dim=64, block_size=16, dtype=torch.float32, gen=generator)
    decodes = sum(r.new == 1 for r in MIXED)
    ours, twin = run_both(batch, device, num_kv_splits=num_kv_splits, num_decodes=decodes, window=window)
    close(ours, paged_attention_ref(**batch, window=window), torch.float32)
    if window == 0:
        close(ours, twin, torch.float32)
