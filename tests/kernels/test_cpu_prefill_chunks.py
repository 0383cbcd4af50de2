"""The paged prefill kernel's key chunks (runs of whole cache blocks, about 64 keys) against its
torch twin: block sizes that divide the chunk and ones that do not, prompts that span several
chunks and query tiles, chunks over cached context, sliding windows; fp32 and bf16."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_attention
from kernels.reference import paged_attention_ref
from tests.kernels.prefill_cases import prefill_case

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)

# Fresh prompts across chunk edges (64, 65) and many tiles (200, 300); chunks over context that
# starts mid-chunk; a verify-sized step over a long context.
SHAPES = [(0, 200), (0, 64), (0, 65), (130, 70), (1000, 3), (7, 129), (0, 300)]


def kernel_and_twin(query, cache, starts, qlens, ctx, table, window=0, twin_table=None):
    """The kernel's rows of every sequence, and the twin's (over ``twin_table``, default the same)."""
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, 7.0)
    cpu_attention.paged_prefill_attention(query, cache, starts, qlens, ctx, table, scale, out, window=window)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), qlens.tolist())])
    loc = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    loc[1:] = qlens.cumsum(0)
    want = paged_attention_ref(
        query[rows].contiguous(),
        cache,
        loc,
        ctx + qlens,
        table if twin_table is None else twin_table,
        scale,
        max_query_len=int(qlens.max()),
        window=window,
    )
    return out, rows, want


def max_error(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("block_size", [1, 5, 16, 48, 128])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 40)])  # SmolLM2's; a size with no specialisation
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_any_block_size_match_the_twin(block_size, heads, dtype):
    gen = torch.Generator().manual_seed(block_size)
    args = prefill_case(gen, SHAPES, *heads, dtype, gap=1, block_size=block_size)
    out, rows, want = kernel_and_twin(*args)
    assert max_error(out[rows], want) <= TOLERANCE[dtype]
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.all(out[others] == 7.0)  # the foreign rows are left alone


@pytest.mark.parametrize("block_size,window", [(5, 23), (16, 70), (48, 50), (128, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_chunks_read_no_block_before_the_window(block_size, window, dtype):
    """Blocks wholly before a sequence's first window point at a block of NaNs: a chunk that
    started before the window's first block would read them."""
    gen = torch.Generator().manual_seed(window)
    shapes = [(300, 40), (0, 150), (222, 1), (90, 90)]
    query, cache, starts, qlens, ctx, table = prefill_case(
        gen, shapes, 9, 3, 64, dtype, gap=1, block_size=block_size
    )
    poisoned = table.clone()
    cache[:, :, 0] = float("nan")
    for i, (c, _) in enumerate(shapes):
        poisoned[i, : max(0, c - window + 1) // block_size] = 0
    out, rows, want = kernel_and_twin(query, cache, starts, qlens, ctx, poisoned, window, twin_table=table)
    assert torch.isfinite(out[rows]).all()
    assert max_error(out[rows], want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_several_fresh_prompts_in_one_call_match_one_call_each(num_threads):
    """The engine sends every prefill of a step in one call: its tiles, claimed by the threads in
    any order, give what a call per prompt gives, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    query, cache, starts, qlens, ctx, table = prefill_case(gen, SHAPES, 9, 3, 64, torch.bfloat16, gap=1)
    scale = 64**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        together = torch.zeros_like(query)
        cpu_attention.paged_prefill_attention(query, cache, starts, qlens, ctx, table, scale, together)
        alone = torch.zeros_like(query)
        for i in range(len(SHAPES)):
            pick = slice(i, i + 1)
            cpu_attention.paged_prefill_attention(
                query, cache, starts[pick], qlens[pick], ctx[pick], table[pick].contiguous(), scale, alone
            )
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone)
