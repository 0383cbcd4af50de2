"""int8 KV caches with fp32 scales per (token, KV head) in the compiled CPU attention kernels:
``write_kv_int8`` against its twin bit for bit, decodes and prefills over int8 caches against
``paged_attention_ref`` on the dequantized cache, on the AVX-512 int8 decode path and the generic
one (``WEFT_ATTENTION_INT8_FAST=0``), and the arguments they refuse."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_build import AVX512_BF16, AVX512_FLAGS, bf16_isa, cpu_flags
from kernels.reference import (
    dequantize_kv_cache,
    paged_attention_ref,
    round_query_int8_ref,
    write_kv_int8_ref,
)
from tests.kernels.test_cpu_attention import _CountOps

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)

HAS_FAST = set(AVX512_FLAGS) <= cpu_flags()  # an AVX-512 build: it has the 512-bit int8 decode path
PATHS = ["fast", "generic"]
# The paths this build tells apart: without AVX-512 "fast" runs the generic path, so the large
# grid below runs it once (the smaller tests still set both, and
# test_decode_takes_the_fast_path_where_the_build_has_it checks that the two agree there).
PATHS_HERE = PATHS if HAS_FAST else ["generic"]


def use_path(monkeypatch, path: str) -> None:
    monkeypatch.setenv(cpu_attention.ENV_INT8_FAST, "1" if path == "fast" else "0")


def int8_cache(gen, num_kv_heads, num_blocks, block_size, head_dim):
    """A cache of random int8 rows with random scales, as ``write_kv_int8`` would leave one."""
    cache = torch.randint(-127, 128, (2, num_kv_heads, num_blocks, block_size, head_dim), generator=gen)
    scales = torch.rand(2, num_kv_heads, num_blocks, block_size, generator=gen) * 0.02 + 0.002
    return cache.to(torch.int8), scales


def block_table(gen, lens, block_size, spare=3):
    """Blocks of every sequence in random order over a pool; block 0 is never handed out."""
    per_seq = [-(-length // block_size) for length in lens]
    num_blocks = sum(per_seq) + spare
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        table[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
    return table, num_blocks


def decode_case(gen, lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16):
    table, num_blocks = block_table(gen, lens, block_size)
    cache, scales = int8_cache(gen, num_kv_heads, num_blocks, block_size, head_dim)
    n = len(lens)
    # The query a view into a wider projection, one spare row before each decode's.
    qkv = torch.randn(2 * n, (num_heads + 2) * head_dim, generator=gen).to(dtype)
    query = qkv[:, : num_heads * head_dim].view(2 * n, num_heads, head_dim)
    token_idx = torch.arange(n) * 2 + 1
    return query, cache, scales, token_idx, torch.tensor(lens, dtype=torch.int32), table


def decode_reference(query, cache, scales, token_idx, seq_lens, table, scale, window=0):
    """Where the kernel rounds the query to int8 for its dot products, the twin rounds it alike."""
    q = query[token_idx].float()
    if cpu_attention.int8_dot_queries(query.dtype, query.shape[-1]):
        q = round_query_int8_ref(q, scale)
    starts = torch.arange(len(token_idx) + 1, dtype=torch.int32)
    kv = dequantize_kv_cache(cache, scales, torch.float32)
    return paged_attention_ref(q, kv, starts, seq_lens, table, scale, max_query_len=1, window=window)


def assert_matches(out, want, dtype):
    """fp32: fp32 arithmetic in another order; bf16 and fp16: one rounding of the output. On int8 dot
    products (bf16 queries, where the CPU has them) the value pass also rounds each run of 128
    weights to int16 against its largest: 2^-16 of it at most, some 1e-5 in absolute terms here
    (the bf16 cache's path rounds each weight to 2^-9 of itself)."""
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=3e-6)
    else:
        step = 2**-8 if dtype == torch.bfloat16 else 2**-11
        atol = 1e-4 if cpu_attention.int8_dot_queries(dtype, out.shape[-1]) else 1e-5
        torch.testing.assert_close(out.float(), want, rtol=step, atol=atol)


def run_decode(query, cache, scales, token_idx, seq_lens, table, scale, window=0):
    out = torch.full(query.shape, 7.0, dtype=query.dtype)
    cpu_attention.paged_decode_attention(
        query, cache, token_idx, seq_lens, table, scale, out, window=window, kv_scales=scales
    )
    return out


# ------------------------------------------------------------------ writes


def write_case(gen, num_tokens, num_kv_heads, head_dim, dtype, num_blocks=40, block_size=16):
    """Keys and values as views of a fused QKV output, over magnitudes from subnormal to huge."""
    heads = 2 + 2 * num_kv_heads
    qkv = torch.randn(num_tokens, heads * head_dim, generator=gen)
    magnitude = 10.0 ** torch.randint(-3, 4, (num_tokens, heads, 1), generator=gen).float()
    qkv = (qkv.view(num_tokens, heads, head_dim) * magnitude).view(num_tokens, -1).to(dtype)
    key = qkv[:, 2 * head_dim : (2 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (2 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    cache = torch.full((2, num_kv_heads, num_blocks, block_size, head_dim), 55, dtype=torch.int8)
    scales = torch.full((2, num_kv_heads, num_blocks, block_size), 7.0)
    return key, value, cache, scales, slots


def write_both(key, value, cache, scales, slots):
    """The kernel's cache and scales, and the twin's, from the same starting cache."""
    got_cache, got_scales = cache.clone(), scales.clone()
    cpu_attention.write_kv_int8(key, value, got_cache, got_scales, slots)
    want_cache, want_scales = cache.clone(), scales.clone()
    write_kv_int8_ref(key, value, want_cache, want_scales, slots)
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got_scales, want_scales, rtol=0, atol=0, equal_nan=True)
    return got_cache, got_scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [5, 1500])  # one thread; parallel over tokens
def test_write_matches_the_twin_bit_for_bit(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    key, value, cache, scales, slots = write_case(gen, num_tokens, 3, 64, dtype, num_blocks=100)
    assert not key.is_contiguous()
    slots[::7] = -1
    got_cache, got_scales = write_both(key, value, cache, scales, slots)
    # Skipped tokens and slots no token maps to keep what they held.
    written = torch.zeros(cache.shape[2] * cache.shape[3], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = got_cache.view(2, 3, -1, 64)
    assert torch.all(flat[:, :, ~written] == 55) and torch.all(
        got_scales.view(2, 3, -1)[:, :, ~written] == 7.0
    )
    # x ~ q * scale, within half a step of the row's scale (plus the roundings of scale, 127 / amax
    # and q * scale: a few ulp of |x| <= 127 steps).
    kv = dequantize_kv_cache(got_cache, got_scales, torch.float32).view(2, 3, -1, 64)
    keep = slots >= 0
    for i, x in enumerate((key, value)):
        back = kv[i][:, slots[keep]].transpose(0, 1)
        step = got_scales.view(2, 3, -1)[i][:, slots[keep]].transpose(0, 1)[..., None]
        assert torch.all((back - x[keep].float()).abs() <= step * (0.5 + 2e-5))


@pytest.mark.parametrize("head_dim", [64, 80, 3])
def test_write_zero_nan_and_extreme_rows(head_dim):
    """A zero row: scale 0 and zeros. A NaN or an infinity anywhere in a row: a NaN scale (and
    zeros). A near-overflow row rounds like any other; a subnormal one (127 / amax overflows, so
    the kernel multiplies by FLT_MAX instead) more coarsely, but as the twin does."""
    gen = torch.Generator().manual_seed(1)
    key, value, cache, scales, slots = write_case(gen, 12, 2, head_dim, torch.float32)
    key, value = key.clone(), value.clone()
    key[0, 0] = 0.0
    value[1, 1] = 0.0
    key[2, 1, head_dim - 1] = float("nan")
    value[3, 0, 0] = float("-inf")
    key[4, 0] = torch.randn(head_dim, generator=gen) * 1e-39  # subnormal: 127 / amax overflows
    value[5, 1] = torch.randn(head_dim, generator=gen) * 1e37
    got_cache, got_scales = write_both(key, value, cache, scales, slots)
    rows = got_cache.view(2, 2, -1, head_dim)
    row_scales = got_scales.view(2, 2, -1)
    assert row_scales[0, 0, slots[0]] == 0 and torch.all(rows[0, 0, slots[0]] == 0)
    assert row_scales[1, 1, slots[1]] == 0 and torch.all(rows[1, 1, slots[1]] == 0)
    assert row_scales[0, 1, slots[2]].isnan() and torch.all(rows[0, 1, slots[2]] == 0)
    assert row_scales[1, 0, slots[3]].isnan() and torch.all(rows[1, 0, slots[3]] == 0)
    assert rows[1, 1, slots[5]].abs().max() == 127 and row_scales[0, 0, slots[4]] > 0


def write_bad_inputs():
    gen = torch.Generator().manual_seed(2)
    key, value, cache, scales, slots = write_case(gen, 6, 2, 64, torch.bfloat16, num_blocks=4)
    good = dict(key=key, value=value, kv_cache=cache, kv_scales=scales, slot_mapping=slots)
    past = slots.clone()
    past[2] = cache.shape[2] * cache.shape[3]
    return good, [
        (dict(slot_mapping=past), "slot_mapping entries must be below"),
        (dict(slot_mapping=slots.int()), "int64"),
        (dict(kv_cache=cache.float()), "int8"),
        (dict(value=value.float()), "one dtype"),
        (dict(key=key.double(), value=value.double()), "float32, bfloat16 or float16"),
        (dict(key=key[:, :1]), "one dtype"),
        (dict(kv_scales=scales[:, :, :, :8]), "kv_scales must be float32"),
        (dict(kv_scales=scales.half()), "kv_scales must be float32"),
        (dict(key=key.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in the head dimension"),
        (dict(kv_cache=cache[:, :1]), "KV heads"),
    ]


@pytest.mark.parametrize("case", range(len(write_bad_inputs()[1])))
@pytest.mark.parametrize("check", [True, False])  # the Python checks, or the kernel's own
def test_write_bad_arguments_get_a_clear_error(case, check):
    good, cases = write_bad_inputs()
    change, message = cases[case]
    args = good | change
    before = args["kv_cache"].clone()
    with pytest.raises(ValueError, match=message if check or case == 0 else None):
        cpu_attention.write_kv_int8(**args, check=check)
    assert torch.equal(args["kv_cache"], before)  # nothing half-written


def test_the_python_checks_run_no_tensor_op():
    good, _ = write_bad_inputs()
    gen = torch.Generator().manual_seed(3)
    query, cache, scales, token_idx, seq_lens, table = decode_case(gen, [20, 5], 9, 3, 64, torch.bfloat16)
    out = torch.empty_like(query)
    with _CountOps() as counted:
        cpu_attention.check_write_kv_int8_args(**good)
        cpu_attention.check_decode_args(query, cache, token_idx, seq_lens, table, out, scales)
    assert counted.ops == []


# ------------------------------------------------------------------ decodes

# SmolLM2's; G = 1 at 64; G = 1 and 3 at 128; a size only the generic path takes
HEADS = [(9, 3, 64), (2, 2, 64), (4, 4, 128), (6, 2, 128), (9, 3, 80)]
BATCHES = {
    "batch32": ([1, 15, 16, 17, 31, 33, 64, 95, 127, 128, 129, 300, 384, 2, 7, 255] * 2, 128),
    "batch1-long": ([3000], 128),  # partitions on 2 threads
    "small-blocks": ([1, 15, 16, 17, 33, 200, 5, 64], 16),
}


@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_matches_the_twin_on_the_dequantized_cache(monkeypatch, path, batch, heads, dtype):
    use_path(monkeypatch, path)
    lens, block_size = BATCHES[batch]
    gen = torch.Generator().manual_seed(len(lens) + heads[2])
    query, cache, scales, token_idx, seq_lens, table = decode_case(gen, lens, *heads, dtype, block_size)
    scale = heads[2] ** -0.5
    out = run_decode(query, cache, scales, token_idx, seq_lens, table, scale)
    assert_matches(
        out[token_idx], decode_reference(query, cache, scales, token_idx, seq_lens, table, scale), dtype
    )
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[token_idx] = False
    assert torch.all(out[others] == 7.0)


@pytest.mark.parametrize("heads", [(9, 3, 64), (6, 2, 128)])
def test_decode_takes_the_fast_path_where_the_build_has_it(monkeypatch, heads):
    """The switch picks a different computation exactly where the build has the AVX-512 path (else
    the "fast" cases above ran the generic path twice); partitioned and not."""
    for lens in ([3000], [40, 3, 70, 17]):
        gen = torch.Generator().manual_seed(8)
        args = decode_case(gen, lens, *heads, torch.float32, 128)
        outs = []
        for path in PATHS:
            use_path(monkeypatch, path)
            outs.append(run_decode(*args, 0.125))
        assert (not torch.equal(outs[0], outs[1])) == HAS_FAST


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [1, 20, 130, 1000])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256)])  # SmolLM2's; Gemma 3's head size
def test_decode_window_reads_no_block_before_it(monkeypatch, path, window, heads):
    """Blocks wholly before each window point at block 0, whose scales are NaN: reading one shows."""
    use_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(window)
    lens, block_size = [1, 15, 16, 17, 129, 300, 1500, 21], 16
    query, cache, scales, token_idx, seq_lens, table = decode_case(
        gen, lens, *heads, torch.float32, block_size
    )
    scale = heads[2] ** -0.5
    want = decode_reference(query, cache, scales, token_idx, seq_lens, table, scale, window)
    poisoned = table.clone()
    scales[:, :, 0] = float("nan")
    for i, length in enumerate(lens):
        poisoned[i, : max(0, length - window) // block_size] = 0
    out = run_decode(query, cache, scales, token_idx, seq_lens, poisoned, scale, window)
    assert_matches(out[token_idx], want, torch.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("which", [0, 1])  # a key row's scale, a value row's
def test_decode_over_a_nan_row_is_nan(monkeypatch, path, which):
    use_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(9)
    query, cache, scales, token_idx, seq_lens, table = decode_case(
        gen, [40, 300, 9], 9, 3, 64, torch.bfloat16, 16
    )
    scales[which, 1, table[1, 3], 5] = float("nan")
    out = run_decode(query, cache, scales, token_idx, seq_lens, table, 0.125)[token_idx]
    assert out[1, 3:6].isnan().all()  # the query heads of KV head 1
    assert out[[0, 2]].isfinite().all() and out[1, :3].isfinite().all() and out[1, 6:].isfinite().all()


def decode_bad_inputs():
    gen = torch.Generator().manual_seed(3)
    query, cache, scales, token_idx, seq_lens, table = decode_case(gen, [20, 5], 6, 2, 64, torch.bfloat16)
    good = dict(
        query=query,
        kv_cache=cache,
        token_idx=token_idx,
        seq_lens=seq_lens,
        block_table=table,
        out=torch.empty_like(query),
        kv_scales=scales,
    )
    too_far = table.clone()
    too_far[0, 1] = cache.shape[2]
    return good, [
        (dict(kv_scales=None), "an int8 kv_cache needs kv_scales"),
        (dict(kv_cache=cache.bfloat16()), "kv_scales go with an int8 kv_cache"),
        (dict(kv_scales=scales[:, :, 1:]), "kv_scales must be"),
        (dict(kv_scales=scales.double()), "kv_scales must be"),
        (dict(kv_scales=scales.transpose(2, 3).contiguous().transpose(2, 3)), "contiguous"),
        (dict(out=torch.empty(query.shape)), "out must match"),
        (dict(query=query.int()), "float32, bfloat16 or float16"),
        (dict(block_table=too_far), "block_table entries"),
    ]


@pytest.mark.parametrize("case", range(len(decode_bad_inputs()[1])))
@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("check", [True, False])  # the Python checks, or the kernel's own
def test_attention_bad_arguments_get_a_clear_error(case, op, check):
    good, cases = decode_bad_inputs()
    change, message = cases[case]
    a = good | change
    with pytest.raises(ValueError, match=message if check or case in (0, 1, 7) else None):
        if op == "decode":
            cpu_attention.paged_decode_attention(
                a["query"], a["kv_cache"], a["token_idx"], a["seq_lens"], a["block_table"], 0.1, a["out"],
                check=check, kv_scales=a["kv_scales"],
            )  # fmt: skip
        else:
            lens = a["seq_lens"]
            cpu_attention.paged_prefill_attention(
                a["query"], a["kv_cache"], a["token_idx"], torch.ones_like(lens), lens - 1, a["block_table"],
                0.1, a["out"], check=check, kv_scales=a["kv_scales"],
            )  # fmt: skip


# ------------------------------------------------------------------ prefills

# Fresh prompts across chunk edges and query tiles; chunks over cached context; a verify-sized step
# over a long context.
SHAPES = [(0, 200), (0, 64), (0, 65), (130, 70), (1000, 3), (7, 129), (0, 40)]


def prefill_case(gen, shapes, num_heads, num_kv_heads, head_dim, dtype, block_size):
    table, num_blocks = block_table(gen, [c + n for c, n in shapes], block_size)
    cache, scales = int8_cache(gen, num_kv_heads, num_blocks, block_size, head_dim)
    starts, row = [], 0
    for _, n in shapes:
        starts.append(row + 1)  # one foreign row before each sequence's
        row += 1 + n
    qkv = torch.randn(row, (num_heads + 2) * head_dim, generator=gen).to(dtype)
    query = qkv[:, : num_heads * head_dim].view(row, num_heads, head_dim)
    qlens = torch.tensor([n for _, n in shapes], dtype=torch.int32)
    ctx = torch.tensor([c for c, _ in shapes], dtype=torch.int32)
    return query, cache, scales, torch.tensor(starts), qlens, ctx, table


def run_prefill(query, cache, scales, starts, qlens, ctx, table, window=0, twin_table=None):
    """The kernel's rows of every sequence, those rows' indices, and the twin's."""
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, 7.0)
    cpu_attention.paged_prefill_attention(
        query, cache, starts, qlens, ctx, table, scale, out, window=window, kv_scales=scales
    )
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), qlens.tolist())])
    loc = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    loc[1:] = qlens.cumsum(0)
    want = paged_attention_ref(
        query[rows].float(),
        dequantize_kv_cache(cache, scales, torch.float32),
        loc,
        ctx + qlens,
        table if twin_table is None else twin_table,
        scale,
        max_query_len=int(qlens.max()),
        window=window,
    )
    return out, rows, want


def assert_prefill_matches(out, want, dtype, head_dim):
    """bf16 queries on bf16 dot products round the keys, values and weights to bf16: the bf16
    prefill tests' tolerance. Otherwise assert_matches's."""
    if cpu_attention.bf16_dot_prefills(dtype, head_dim):
        assert (out.float() - want).abs().max().item() <= 2e-2
    else:
        assert_matches(out, want, dtype)


# (query dtype, WEFT_ATTENTION_BF16_DOT, WEFT_ATTENTION_AMX): bf16 queries on AMX tiles (where the CPU
# has them; else vdpbf16ps again), on vdpbf16ps, and on the fp32 path
DTYPES = [
    (torch.float32, "1", "1"),
    (torch.bfloat16, "1", "1"),
    (torch.bfloat16, "1", "0"),
    (torch.bfloat16, "0", "1"),
    (torch.float16, "1", "1"),
]
# Without AVX512_BF16 the three bf16 settings run the one fp32 path: there the grid runs bf16 once,
# with both switches on (the path they fall back to).
DTYPES_HERE = DTYPES if bf16_isa() == AVX512_BF16 else [DTYPES[0], DTYPES[1], DTYPES[4]]


@pytest.mark.parametrize("block_size", [5, 16, 128])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (4, 2, 80)])
@pytest.mark.parametrize("dtype,bf16_dot,amx", DTYPES_HERE)
def test_prefill_matches_the_twin_on_the_dequantized_cache(
    monkeypatch, block_size, heads, dtype, bf16_dot, amx
):
    monkeypatch.setenv(cpu_attention.ENV_BF16_DOT, bf16_dot)
    monkeypatch.setenv(cpu_attention.ENV_AMX, amx)
    gen = torch.Generator().manual_seed(block_size)
    out, rows, want = run_prefill(*prefill_case(gen, SHAPES, *heads, dtype, block_size))
    assert_prefill_matches(out[rows], want, dtype, heads[2])
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.all(out[others] == 7.0)


@pytest.mark.parametrize("block_size,window", [(5, 23), (16, 70), (128, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_window_reads_no_block_before_it(block_size, window, dtype):
    gen = torch.Generator().manual_seed(window)
    shapes = [(300, 40), (0, 150), (222, 1), (90, 90)]
    query, cache, scales, starts, qlens, ctx, table = prefill_case(gen, shapes, 9, 3, 64, dtype, block_size)
    poisoned = table.clone()
    scales[:, :, 0] = float("nan")
    for i, (c, _) in enumerate(shapes):
        poisoned[i, : max(0, c - window + 1) // block_size] = 0
    out, rows, want = run_prefill(
        query, cache, scales, starts, qlens, ctx, poisoned, window, twin_table=table
    )
    assert_prefill_matches(out[rows], want, dtype, 64)


def test_written_cache_round_trip_through_decode():
    """write_kv_int8 then a decode over what it wrote, against the twin on the float K/V's
    rounding: the two ops agree on the layout of cache and scales."""
    gen = torch.Generator().manual_seed(11)
    lens, block_size, kvh, d = [70, 5, 129], 16, 3, 64
    table, num_blocks = block_table(gen, lens, block_size)
    cache = torch.zeros(2, kvh, num_blocks, block_size, d, dtype=torch.int8)
    scales = torch.zeros(2, kvh, num_blocks, block_size)
    for i, length in enumerate(lens):
        pos = torch.arange(length)
        slots = table[i, pos // block_size].long() * block_size + pos % block_size
        kv = torch.randn(2, length, kvh, d, generator=gen).bfloat16()
        cpu_attention.write_kv_int8(kv[0], kv[1], cache, scales, slots)
    query = torch.randn(len(lens), 9, d, generator=gen).bfloat16()
    token_idx, seq_lens = torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int32)
    out = run_decode(query, cache, scales, token_idx, seq_lens, table, 0.125)
    assert_matches(
        out, decode_reference(query, cache, scales, token_idx, seq_lens, table, 0.125), torch.bfloat16
    )
