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
    # SmolLM2, MHA, an odd size, Gemma 3's heads, a size not a multiple of 8 (the AVX2 tiles' scalar rest)
    [(9, 3, 64), (4, 4, 128), (8, 2, 40), (4, 1, 256), (6, 2, 36)],
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


# bf16 prefills on CPUs with AVX512_BF16 take bf16 dot products (P rounded to bf16, as GPU flash
# attention does); WEFT_ATTENTION_BF16_DOT=0 keeps them on the fp32 path every other CPU runs.
# Shapes at the causal diagonal's edges: a 16-key group, a 64-key chunk, a 32-token tile of G = 3
# (96 rows), a 6-row block, odd token counts (the last value pair half empty), contexts not a
# multiple of a block or a chunk.
BF16_SHAPES = [
    (0, 1), (0, 2), (0, 3), (0, 16), (0, 31), (0, 33), (0, 64), (0, 65), (0, 97), (0, 200),
    (15, 17), (16, 16), (47, 50), (63, 1), (64, 129), (300, 4), (1, 33), (5, 70),
]  # fmt: skip
BF16_HEADS = [(9, 3, 64), (6, 3, 64), (8, 2, 64), (4, 4, 128), (4, 1, 256), (8, 2, 40), (2, 1, 32)]


# The bf16 prefill paths as (WEFT_ATTENTION_BF16_DOT, WEFT_ATTENTION_AMX): AMX tiles (where the CPU has
# them, for head sizes of a multiple of 64 and block sizes of 16; else vdpbf16ps), vdpbf16ps, fp32.
BF16_PATHS = {"amx": ("1", "1"), "bf16-dot": ("1", "0"), "fp32": ("0", "1")}


def bf16_paths_here() -> list[str]:
    """The settings that run different code on this CPU: without AVX512_BF16 all three run the fp32
    path, so the grid below runs it once (the other settings' fallback is checked at the other
    block sizes and by test_bf16_prefill_takes_the_bf16_dot_path_where_the_cpu_has_it)."""
    from kernels.cpu_build import AVX512_BF16, bf16_isa

    return list(BF16_PATHS) if bf16_isa() == AVX512_BF16 else ["fp32"]


def set_bf16_path(monkeypatch, path: str) -> None:
    bf16_dot, amx = BF16_PATHS[path]
    monkeypatch.setenv(cpu_attention.ENV_BF16_DOT, bf16_dot)
    monkeypatch.setenv(cpu_attention.ENV_AMX, amx)


@pytest.mark.parametrize("path", bf16_paths_here())
@pytest.mark.parametrize("window", [0, 1, 20, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", BF16_HEADS)
def test_bf16_prefill_paths_match_the_twin(monkeypatch, path, window, num_heads, num_kv_heads, head_dim):
    set_bf16_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(5)
    query, cache, starts, qlens, ctx, table = prefill_case(
        gen, BF16_SHAPES, num_heads, num_kv_heads, head_dim, torch.bfloat16
    )
    query.mul_(3.0)  # peakier softmaxes: later chunks rescale earlier ones
    scale = head_dim**-0.5
    out = run_kernel(query, cache, starts, qlens, ctx, table, scale, window)
    rows, want = twin(query, cache, starts, qlens, ctx, table, scale, window)
    # The existing bf16 tolerance, or one bf16 step of the value (2^-7 of it) where that is larger:
    # the kernel's weights are bf16, so a result near a rounding midpoint may round the other way.
    torch.testing.assert_close(out[rows].float(), want.float(), atol=TOLERANCE[torch.bfloat16], rtol=2**-7)
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.all(out[others] == 7.0)


@pytest.mark.parametrize("block_size", [5, 8, 32, 128])
def test_bf16_prefill_paths_match_the_twin_at_other_block_sizes(monkeypatch, block_size):
    """Chunks of other sizes than 64 keys; an odd block size puts a value pair across two blocks (and
    keeps AMX tiles off: a tile's 16 keys must come from one block)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(0, 1), (0, 37), (3, 70), (130, 9), (0, 130)]
    args = prefill_case(gen, shapes, 9, 3, 64, torch.bfloat16, block_size=block_size)
    for path in BF16_PATHS:
        set_bf16_path(monkeypatch, path)
        for window in (0, 20):
            out = run_kernel(*args, 0.125, window)
            rows, want = twin(*args, 0.125, window)
            torch.testing.assert_close(
                out[rows].float(), want.float(), atol=TOLERANCE[torch.bfloat16], rtol=2**-7
            )


def test_bf16_prefill_takes_the_bf16_dot_path_where_the_cpu_has_it(monkeypatch):
    """The switch picks a different computation exactly where the build has the bf16 path (else the
    bf16-dot cases above ran the fp32 path twice)."""
    from kernels.cpu_build import bf16_isa, cpu_flags

    gen = torch.Generator().manual_seed(6)
    args = prefill_case(gen, [(0, 100), (40, 30)], 9, 3, 64, torch.bfloat16)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv(cpu_attention.ENV_BF16_DOT, flag)
        outs.append(run_kernel(*args, 0.125))
    has_bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()
    assert (bf16_isa()[0] == "avx512bf16") == has_bf16
    assert (not torch.equal(outs[0], outs[1])) == has_bf16


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (256, 16), (64, 8), (32, 16)])
def test_bf16_prefill_takes_amx_tiles_where_the_cpu_has_them(monkeypatch, head_dim, block_size):
    """The AMX switch picks a different computation exactly where amx_prefills says the kernel runs
    tiles (else the amx cases above ran vdpbf16ps twice): a CPU with amx_tile and amx_bf16, head sizes
    of a multiple of 64, block sizes of a multiple of 16, and the opt-in bf16 dot path asked for (at
    the default, prefills run the batch-invariant fp32 tiles and no AMX)."""
    from kernels.cpu_build import cpu_flags

    gen = torch.Generator().manual_seed(8)
    args = prefill_case(gen, [(0, 100), (40, 30)], 8, 2, head_dim, torch.bfloat16, block_size=block_size)
    monkeypatch.delenv(cpu_attention.ENV_BF16_DOT, raising=False)
    monkeypatch.setenv(cpu_attention.ENV_AMX, "1")
    assert not cpu_attention.amx_prefills(torch.bfloat16, head_dim, block_size)
    monkeypatch.setenv(cpu_attention.ENV_BF16_DOT, "1")
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv(cpu_attention.ENV_AMX, flag)
        outs.append(run_kernel(*args, head_dim**-0.5))
    monkeypatch.setenv(cpu_attention.ENV_AMX, "1")
    on = cpu_attention.amx_prefills(torch.bfloat16, head_dim, block_size)
    has_amx = {"avx512_bf16", "amx_tile", "amx_bf16"} <= cpu_flags()
    assert on == (has_amx and head_dim % 64 == 0 and block_size % 16 == 0)
    assert (not torch.equal(outs[0], outs[1])) == on
