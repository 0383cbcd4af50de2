"""The compiled CPU paged prefill kernel against its torch twin, and the decode kernel's partitions."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_attention
from kernels.reference import paged_attention_ref
from tests.kernels.prefill_cases import prefill_case

BS = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)


def twin(query, cache, starts, qlens, ctx, table, scale, window=0):
    """The twin over the sequences' rows packed back to back; returns them in that order."""
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), qlens.tolist())])
    loc = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    loc[1:] = qlens.cumsum(0)
    q = query[rows].contiguous()
    want = paged_attention_ref(
        q, cache, loc, ctx + qlens, table, scale, max_query_len=int(qlens.max()), window=window
    )
    return rows, want


def run_kernel(query, cache, starts, qlens, ctx, table, scale, window=0, fill=7.0):
    out = torch.full(query.shape, fill, dtype=query.dtype)
    cpu_attention.paged_prefill_attention(query, cache, starts, qlens, ctx, table, scale, out, window=window)
    return out


def max_error(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


# Chunks after context and fresh prompts, at and around block edges, one long enough for several
# query tiles, one a verify step of a few tokens over a long context.
SHAPES = [(0, 1), (0, 15), (0, 17), (16, 16), (33, 5), (5, 70), (300, 4), (1, 33)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (4, 4, 128), (8, 2, 40), (4, 1, 256)],  # SmolLM2, MHA, an odd size, Gemma 3's heads
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_matches_the_torch_twin(num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    args = prefill_case(gen, SHAPES, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = run_kernel(*args, scale)
    rows, want = twin(*args, scale)
    assert max_error(out[rows], want) <= TOLERANCE[dtype]
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.all(out[others] == 7.0)  # rows of no prefill are left as they are


@pytest.mark.parametrize("window", [1, 16, 20, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_sliding_window_reads_no_block_before_it(window, dtype):
    gen = torch.Generator().manual_seed(1)
    shapes = [(0, 40), (100, 7), (17, 30), (64, 1), (5, 90)]
    query, cache, starts, qlens, ctx, table = prefill_case(gen, shapes, 4, 1, 256, dtype)
    scale = 256**-0.5
    rows, want = twin(query, cache, starts, qlens, ctx, table, scale, window)
    # Blocks wholly before the first query's window point at a block of NaNs: reading one would show.
    poisoned = table.clone()
    cache[:, :, 0] = float("nan")
    for i, (c, _) in enumerate(shapes):
        poisoned[i, : max(0, c - window + 1) // BS] = 0
    out = run_kernel(query, cache, starts, qlens, ctx, poisoned, scale, window)
    assert torch.isfinite(out[rows]).all()
    assert max_error(out[rows], want) <= TOLERANCE[dtype]


def test_prefill_large_scores_keep_the_online_softmax_exact():
    """Scores hundreds apart, the largest in a late block: every earlier block is rescaled."""
    gen = torch.Generator().manual_seed(2)
    query, cache, starts, qlens, ctx, table = prefill_case(gen, [(200, 20), (0, 50)], 9, 3, 64, torch.float32)
    query.mul_(40.0)
    out = run_kernel(query, cache, starts, qlens, ctx, table, 0.125)
    rows, want = twin(query, cache, starts, qlens, ctx, table, 0.125)
    torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=1e-5)


def test_prefill_of_no_sequences_is_a_no_op():
    query, cache = torch.randn(3, 4, 64), torch.randn(2, 2, 4, BS, 64)
    none = torch.zeros(0, dtype=torch.int32)
    out = run_kernel(query, cache, none.long(), none, none, none.view(0, 1), 0.1)
    assert torch.all(out == 7.0)


def prefill_bad_inputs():
    gen = torch.Generator().manual_seed(3)
    query, cache, starts, qlens, ctx, table = prefill_case(gen, [(20, 5), (0, 3)], 6, 2, 64, torch.float32)
    good = dict(
        query=query, kv_cache=cache, query_start=starts, query_lens=qlens, context_lens=ctx, block_table=table
    )
    too_far = table.clone()
    too_far[0, 1] = cache.shape[2]
    return good, [
        (dict(kv_cache=cache.to(torch.bfloat16)), "share a float dtype"),
        (dict(query=query[:, :5]), "multiple of KV heads"),
        (dict(query_start=starts.int()), "query_start must be int64"),
        (dict(query_lens=torch.tensor([5, 0], dtype=torch.int32)), "query_lens must be positive"),
        (dict(context_lens=torch.tensor([-1, 0], dtype=torch.int32)), "context_lens non-negative"),
        (dict(query_start=torch.tensor([2, query.shape[0] - 1])), "query_start \\+ query_lens must lie in"),
        (
            dict(context_lens=torch.tensor([30, 0], dtype=torch.int32)),
            "context_lens \\+ query_lens must be at most",
        ),
        (dict(block_table=too_far), "block_table entries in use"),
        (dict(block_table=table[:1]), "block_table must be int32"),
        (dict(query_lens=qlens[:1]), "must all be \\[R\\]"),
    ]


@pytest.mark.parametrize("case", range(len(prefill_bad_inputs()[1])))
def test_prefill_bad_arguments_get_a_clear_error(case):
    good, cases = prefill_bad_inputs()
    change, message = cases[case]
    a = good | change
    out = torch.empty(a["query"].shape, dtype=a["query"].dtype)
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_prefill_attention(
            a["query"],
            a["kv_cache"],
            a["query_start"],
            a["query_lens"],
            a["context_lens"],
            a["block_table"],
            0.1,
            out,
        )


def test_index_values_are_checked_by_the_kernel_even_without_the_python_checks():
    good, _ = prefill_bad_inputs()
    table = good["block_table"].clone()
    table[1, 0] = -1
    out = torch.empty(good["query"].shape)
    with pytest.raises(ValueError, match="block_table entries in use"):
        cpu_attention.paged_prefill_attention(
            good["query"], good["kv_cache"], good["query_start"], good["query_lens"], good["context_lens"], table,
            0.1, out, check=False,
        )  # fmt: skip


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_partitions_match_the_twin(threads, num_threads, dtype):
    """Few (decode, KV head) pairs per thread: long contexts are cut into partitions and merged
    (batch 1 and 2 of SmolLM2's heads, lengths no partition size divides, a window)."""
    threads(num_threads)
    gen = torch.Generator().manual_seed(4)
    for lens, window in (([1000], 0), ([777, 65], 0), ([2049], 300), ([64], 0)):
        query, cache, starts, qlens, ctx, table = prefill_case(
            gen, [(n - 1, 1) for n in lens], 9, 3, 64, dtype, gap=0
        )
        out = torch.full(query.shape, 7.0, dtype=dtype)
        cpu_attention.paged_decode_attention(query, cache, starts, ctx + 1, table, 0.125, out, window=window)
        rows, want = twin(query, cache, starts, qlens, ctx, table, 0.125, window)
        assert max_error(out[rows], want) <= TOLERANCE[dtype], (lens, window)
