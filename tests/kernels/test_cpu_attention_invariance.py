"""The CPU attention kernels' results do not depend on the batch: a query row's output is the same,
bit for bit, whatever else the call holds and however the call cut the work.

- A prefill's or prefill chunk's rows (one chunk, two chunks, one row at a time: a speculative
  verify step's) equal the decode kernel's output for each row at its own context length.
- A decode's output is the same alone in the call or beside 7, 31 or 63 others of varied lengths
  (which changes how the decode kernel cuts each sequence's keys into partitions for the threads),
  on 1 and 2 threads.

fp32 and bf16 caches, head sizes 64 and 128, GQA and not, sliding windows on and off. The int8
cache's AVX-512 decode paths and the bf16 dot-product paths (AVX512_BF16, opt-in) are not
batch-invariant and are not run here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import torch

from kernels import cpu_attention

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)

BLOCK_SIZE = 16
# (context + new tokens) of each sequence: long ones span several 256-key segments, short ones none.
LENGTHS = [1100, 37, 600, 300]


@pytest.fixture(autouse=True)
def _fp32_bf16_path(monkeypatch):
    """The batch-invariant paths: no bf16 dot products (where the CPU has them)."""
    monkeypatch.setenv(cpu_attention.ENV_BF16_DOT, "0")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def paged_cache(gen, lengths, num_kv_heads, head_dim, dtype):
    """A cache whose sequences' blocks sit in random order, and their block table."""
    per_seq = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(per_seq) + 2
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        table[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
    cache = torch.randn(2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    return cache, table


def decode(query, cache, rows, seq_lens, table, window):
    """The decode kernel's output for query rows ``rows`` at their sequences' lengths."""
    out = torch.zeros_like(query)
    cpu_attention.paged_decode_attention(
        query,
        cache,
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(seq_lens, dtype=torch.int32),
        table.contiguous(),
        query.shape[-1] ** -0.5,
        out,
        window=window,
    )
    return out


def prefill(query, cache, starts, qlens, ctx, table, window):
    out = torch.zeros_like(query)
    cpu_attention.paged_prefill_attention(
        query,
        cache,
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(qlens, dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32),
        table.contiguous(),
        query.shape[-1] ** -0.5,
        out,
        window=window,
    )
    return out


# Each sequence's last `new` tokens run as a prefill over its context, cut at these points: one
# chunk; two chunks; one row at a time (as speculative verify rows and decodes are).
SPLITS = {
    "one chunk": lambda new: [new],
    "two chunks": lambda new: [new // 3, new - new // 3],
    "rows": lambda new: [1] * new,
}


@pytest.fixture(scope="module")
def decoded() -> Iterator[dict]:
    """The decode kernel's rows, one alone a call, kept for the three splits of the same case (the
    same seed gives them the same cache and queries): 365 calls a case."""
    rows: dict[tuple, torch.Tensor] = {}
    yield rows
    rows.clear()


@pytest.mark.parametrize("window", [0, 200])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (8, 2, 128)])  # GQA (SmolLM2's), MHA, GQA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", list(SPLITS))
def test_prefill_rows_equal_the_decode_of_each_row(decoded, split, dtype, heads, window):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(1)
    cache, table = paged_cache(gen, LENGTHS, num_kv_heads, head_dim, dtype)
    new = [19, 37, 9, 300]  # tokens of each sequence run as prefill rows (the last: a fresh prompt)
    total = sum(new)
    query = torch.randn(total + 3, num_heads, head_dim, generator=gen).to(dtype)
    # Row of token t of sequence i: every sequence's rows one after another, from row 3.
    first_row = [3 + sum(new[:i]) for i in range(len(new))]

    # The decode kernel, each row alone at its own length: seq i's token t sits at position
    # LENGTHS[i] - new[i] + t and sees the keys up to it.
    if (dtype, heads, window) not in decoded:
        want = torch.zeros_like(query)
        for i, n in enumerate(new):
            for t in range(n):
                r = first_row[i] + t
                length = LENGTHS[i] - n + t + 1
                want[r] = decode(query, cache, [r], [length], table[i : i + 1], window)[r]
        decoded[dtype, heads, window] = want
    want = decoded[dtype, heads, window]

    # The prefill kernel: every sequence's rows cut into chunks, the chunks of one cut in one call.
    pieces = [SPLITS[split](n) for n in new]
    got = torch.zeros_like(query)
    for step in range(max(len(p) for p in pieces)):
        starts, qlens, ctx, seqs = [], [], [], []
        for i, p in enumerate(pieces):
            if step < len(p):
                done = sum(p[:step])
                starts.append(first_row[i] + done)
                qlens.append(p[step])
                ctx.append(LENGTHS[i] - new[i] + done)
                seqs.append(i)
        out = prefill(query, cache, starts, qlens, ctx, table[seqs], window)
        for s, q in zip(starts, qlens):
            got[s : s + q] = out[s : s + q]
    assert torch.equal(got[3:], want[3:])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("others", [7, 31, 63])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_is_the_same_alone_and_in_a_batch(dtype, heads, window, others, threads, two_threads):
    torch.set_num_threads(threads)
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(others)
    # The decode of interest first (a long context, which the kernel cuts when it is alone), then
    # others, long and short.
    lengths = [1500] + torch.randint(1, 2100, (others,), generator=gen).tolist()
    lengths[1] = 5
    cache, table = paged_cache(gen, lengths, num_kv_heads, head_dim, dtype)
    query = torch.randn(others + 1, num_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(others + 1, generator=gen).tolist()  # the rows in the call, any order
    alone = decode(query, cache, [0], lengths[:1], table[:1], window)
    batch = decode(query, cache, order, [lengths[i] for i in order], table[order], window)
    assert torch.equal(alone[0], batch[0])
    for i in (1, others):  # a short and another one, each alone
        assert torch.equal(decode(query, cache, [i], [lengths[i]], table[i : i + 1], window)[i], batch[i])
