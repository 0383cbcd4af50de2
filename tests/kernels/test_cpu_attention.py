"""The compiled CPU decode-attention kernel against its torch twin, and the cpu backend's selection."""

from __future__ import annotations

import logging
import os
import shutil
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import cpu_attention
from kernels.reference import paged_attention_ref
from services.worker.layers import backends
from services.worker.layers.backends import check_backend

BS = 16

# The kernel is built with the machine's compiler (weft falls back to the torch path without one).
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)


def decode_case(gen, lens, num_heads, num_kv_heads, head_dim, dtype, num_tokens=None, spare_blocks=5):
    """Decodes of the given lengths over blocks in random order; query rows scattered over a
    wider batch of ``num_tokens`` (default: one row per decode, in order)."""
    n = len(lens)
    per_seq = [-(-length // BS) for length in lens]
    num_blocks = sum(per_seq) + spare_blocks
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(n, max(per_seq), dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        table[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
    cache = torch.randn(2, num_kv_heads, num_blocks, BS, head_dim, generator=gen).to(dtype)
    num_tokens = num_tokens or n
    token_idx = (
        torch.randperm(num_tokens, generator=gen)[:n].sort().values if num_tokens > n else torch.arange(n)
    )
    # The query is a view into a wider projection, as the model's q is of its fused qkv.
    qkv = torch.randn(num_tokens, (num_heads + 2) * head_dim, generator=gen).to(dtype)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    return query, cache, token_idx, torch.tensor(lens, dtype=torch.int32), table


def reference(query, cache, token_idx, seq_lens, table, scale, window=0):
    q = query[token_idx].contiguous()
    starts = torch.arange(len(token_idx) + 1, dtype=torch.int32)
    return paged_attention_ref(q, cache, starts, seq_lens, table, scale, max_query_len=1, window=window)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@needs_compiler
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [
        (9, 3, 64),
        (4, 4, 128),
        (8, 2, 40),
    ],  # SmolLM2's GQA; no grouping at 128; a size with no fixed-size path
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_torch_twin(num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    # Lengths at and around block edges, a single key, and one long sequence.
    lens = [1, 15, 16, 17, 32, 33, 5, 300, 2, 64]
    query, cache, token_idx, seq_lens, table = decode_case(
        gen, lens, num_heads, num_kv_heads, head_dim, dtype
    )
    out = torch.zeros(query.shape, dtype=dtype)
    scale = head_dim**-0.5
    cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, scale, out)
    want = reference(query, cache, token_idx, seq_lens, table, scale)
    assert (out.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]


@needs_compiler
@pytest.mark.parametrize("window", [1, 16, 20, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 1, 256), (9, 3, 64)])  # Gemma 3's, SmolLM2's
def test_sliding_window_matches_the_torch_twin_and_reads_no_block_before_it(
    window, dtype, num_heads, num_kv_heads, head_dim
):
    gen = torch.Generator().manual_seed(4)
    lens = [1, 15, 16, 17, 33, 70, 300, 21]
    query, cache, token_idx, seq_lens, table = decode_case(
        gen, lens, num_heads, num_kv_heads, head_dim, dtype
    )
    scale = head_dim**-0.5
    want = reference(query, cache, token_idx, seq_lens, table, scale, window)
    # Blocks wholly before each window point at a block of NaNs: reading one would show.
    poisoned = table.clone()
    cache[:, :, 0] = float("nan")
    for i, length in enumerate(lens):
        poisoned[i, : max(0, length - window) // BS] = 0
    out = torch.zeros(query.shape, dtype=dtype)
    cpu_attention.paged_decode_attention(
        query, cache, token_idx, seq_lens, poisoned, scale, out, window=window
    )
    assert torch.isfinite(out).all()
    assert (out.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]
    with pytest.raises(ValueError, match="window"):
        cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, scale, out, window=-1)


@needs_compiler
def test_writes_only_the_rows_of_its_decodes():
    gen = torch.Generator().manual_seed(1)
    query, cache, token_idx, seq_lens, table = decode_case(
        gen, [40, 3, 70], 6, 2, 64, torch.float32, num_tokens=9
    )
    out = torch.full(query.shape, 7.0)
    cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, 0.125, out)
    torch.testing.assert_close(
        out[token_idx], reference(query, cache, token_idx, seq_lens, table, 0.125), atol=2e-5, rtol=1e-5
    )
    others = torch.ones(9, dtype=torch.bool)
    others[token_idx] = False
    assert torch.all(out[others] == 7.0)


@needs_compiler
def test_large_scores_keep_the_softmax_exact():
    """Scores far apart (hundreds): the max is subtracted, and tiny weights underflow to ~0."""
    gen = torch.Generator().manual_seed(2)
    query, cache, token_idx, seq_lens, table = decode_case(gen, [200, 50], 9, 3, 64, torch.float32)
    query.mul_(40.0)
    out = torch.empty(query.shape)
    cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, 0.125, out)
    torch.testing.assert_close(
        out, reference(query, cache, token_idx, seq_lens, table, 0.125), atol=2e-5, rtol=1e-5
    )
    assert torch.isfinite(out).all()


@needs_compiler
@pytest.mark.parametrize("path", ["bf16-dot", "fp32"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
def test_bf16_decodes_read_no_row_past_their_length(
    monkeypatch, path, block_size, num_heads, num_kv_heads, head_dim
):
    """bf16 caches on AVX512_BF16 CPUs take the bf16 dot products (``WEFT_ATTENTION_BF16_DOT=0``:
    the fp32 path): key rows are scored 16 at a time and value rows weighted two at a time, so a
    block's last rows (past a sequence's length) sit beside rows in use. Those rows hold NaN here:
    one read would show. Blocks of 8 and 32 rows cut the groups of 16 differently; lengths are odd
    and even, shorter and longer than 16."""
    monkeypatch.setenv(cpu_attention.ENV_BF16_DOT, "1" if path == "bf16-dot" else "0")
    gen = torch.Generator().manual_seed(5)
    lens = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 95, 300]
    n, per_seq = len(lens), [-(-length // block_size) for length in lens]
    num_blocks = sum(per_seq) + 3
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(n, max(per_seq), dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        table[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen).bfloat16()
    for i, length in enumerate(lens):
        if length % block_size:
            cache[:, :, table[i, per_seq[i] - 1], length % block_size :] = float("nan")
    query = torch.randn(n, num_heads, head_dim, generator=gen).bfloat16()
    seq_lens, token_idx, scale = torch.tensor(lens, dtype=torch.int32), torch.arange(n), head_dim**-0.5
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, scale, out)
    assert torch.isfinite(out).all()
    starts = torch.arange(n + 1, dtype=torch.int32)
    want = paged_attention_ref(query, cache, starts, seq_lens, table, scale, max_query_len=1)
    # The bf16 tolerance, or one bf16 step of the value (2^-7 of it) where that is larger: the
    # bf16-dot path rounds the softmax weights to bf16.
    torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[torch.bfloat16], rtol=2**-7)


@needs_compiler
def test_bf16_decode_takes_the_bf16_dot_path_where_the_cpu_has_it(monkeypatch):
    """The switch picks a different computation exactly where the build has the bf16 path (else
    the bf16-dot cases above ran the fp32 path twice); partitioned (batch 1, long) and not."""
    from kernels.cpu_build import cpu_flags

    has_bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()
    for lens in ([3000], [40, 3, 70, 17]):
        gen = torch.Generator().manual_seed(8)
        query, cache, token_idx, seq_lens, table = decode_case(gen, lens, 9, 3, 64, torch.bfloat16)
        want = reference(query, cache, token_idx, seq_lens, table, 0.125)
        outs = []
        for flag in ("1", "0"):
            monkeypatch.setenv(cpu_attention.ENV_BF16_DOT, flag)
            outs.append(torch.zeros(query.shape, dtype=torch.bfloat16))
            cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, 0.125, outs[-1])
            torch.testing.assert_close(outs[-1].float(), want.float(), atol=TOLERANCE[torch.bfloat16], rtol=0)
        assert (not torch.equal(outs[0], outs[1])) == has_bf16


@needs_compiler
def test_bf16_large_scores_keep_the_softmax_exact():
    gen = torch.Generator().manual_seed(2)
    query, cache, token_idx, seq_lens, table = decode_case(gen, [200, 50, 3], 9, 3, 64, torch.bfloat16)
    query.mul_(40.0)
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, 0.125, out)
    want = reference(query, cache, token_idx, seq_lens, table, 0.125)
    assert torch.isfinite(out).all()
    assert (out.float() - want.float()).abs().max().item() <= TOLERANCE[torch.bfloat16]


@needs_compiler
def test_no_decodes_is_a_no_op():
    query, out = torch.randn(3, 4, 64), torch.zeros(3, 4, 64)
    cache = torch.randn(2, 2, 4, BS, 64)
    empty = torch.zeros(0, dtype=torch.int32)
    cpu_attention.paged_decode_attention(query, cache, empty.long(), empty, empty.view(0, 1), 0.1, out)
    assert torch.all(out == 0)


def bad_inputs():
    gen = torch.Generator().manual_seed(3)
    q, cache, idx, lens, table = decode_case(gen, [20, 5], 6, 2, 64, torch.float32, spare_blocks=1)
    out = torch.empty(q.shape)
    good = dict(query=q, kv_cache=cache, token_idx=idx, seq_lens=lens, block_table=table, out=out)
    too_far = table.clone()
    too_far[0, 1] = cache.shape[2]
    return good, [
        (dict(kv_cache=cache.to(torch.float16)), "share a float dtype"),
        (dict(query=q[:, :5]), "multiple of KV heads"),
        (dict(seq_lens=lens.long()), "int32"),
        (dict(seq_lens=torch.tensor([20, 40], dtype=torch.int32)), "seq_lens must lie in"),
        (dict(seq_lens=torch.tensor([0, 5], dtype=torch.int32)), "seq_lens must lie in"),
        (dict(block_table=too_far), "block_table entries"),
        (dict(token_idx=torch.tensor([0, 2])), "token_idx must lie in"),
        (dict(out=torch.empty(2, 6, 32)), "out must match"),
        (dict(kv_cache=torch.cat([cache, cache], -1)[..., :64]), "contiguous"),
    ]


@pytest.mark.parametrize("case", range(len(bad_inputs()[1])))
def test_bad_arguments_get_a_clear_error(case):
    good, cases = bad_inputs()
    change, message = cases[case]
    args = good | change
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_decode_attention(
            args["query"],
            args["kv_cache"],
            args["token_idx"],
            args["seq_lens"],
            args["block_table"],
            0.1,
            args["out"],
        )


def test_cpu_backend_selection(monkeypatch, caplog):
    if shutil.which(os.environ.get("CXX", "c++")) is not None:
        assert check_backend("cpu", torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="runs on CPU devices"):
        check_backend("cpu", torch.device("cuda"))

    def cannot_build():
        raise cpu_attention.KernelUnavailable("building the CPU attention kernel needs c++ on PATH.")

    monkeypatch.setattr(cpu_attention, "load", cannot_build)
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert check_backend("cpu", torch.device("cpu")) == "torch"
    assert "needs c++" in caplog.text and "falls back to the torch backend" in caplog.text


def test_missing_tools_are_named(monkeypatch):
    cpu_attention.load.cache_clear()
    try:
        monkeypatch.setenv("PATH", "/nonexistent")
        monkeypatch.setattr(sys, "executable", "/nonexistent/python")
        with pytest.raises(cpu_attention.KernelUnavailable, match="needs ninja"):
            cpu_attention.load()
    finally:
        cpu_attention.load.cache_clear()


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_the_python_checks_run_no_tensor_op():
    """They read shapes, dtypes and strides only (each tensor op costs microseconds of dispatch);
    the values the kernel reads memory through are checked in the kernel."""
    good, _ = bad_inputs()
    with _CountOps() as counted:
        cpu_attention.check_decode_args(
            good["query"],
            good["kv_cache"],
            good["token_idx"],
            good["seq_lens"],
            good["block_table"],
            good["out"],
        )
    assert counted.ops == []


@needs_compiler
@pytest.mark.parametrize("value", ["off", "2", ""])
def test_a_bad_bf16_dot_switch_is_refused_by_name(monkeypatch, value):
    """Neither the load check nor the kernel reads an unknown value as on or off."""
    monkeypatch.setenv(cpu_attention.ENV_BF16_DOT, value)
    with pytest.raises(ValueError, match="WEFT_ATTENTION_BF16_DOT must be 0 or 1"):
        cpu_attention.check_bf16_dot_env()
    gen = torch.Generator().manual_seed(3)
    query, cache, token_idx, seq_lens, table = decode_case(gen, [20, 5], 9, 3, 64, torch.bfloat16)
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="WEFT_ATTENTION_BF16_DOT must be 0 or 1"):
        cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, 0.125, out)
    assert torch.all(out == 0)  # nothing half-written


@needs_compiler
@pytest.mark.parametrize("value", ["off", "2"])
def test_a_bad_amx_switch_is_refused_by_name(monkeypatch, value):
    """The prefill kernel reads WEFT_ATTENTION_AMX on every call, whatever the CPU, and refuses a value
    other than 0 or 1 before it writes anything."""
    from tests.kernels.prefill_cases import prefill_case

    cpu_attention.load()  # built and loaded with the switch unset
    monkeypatch.setenv(cpu_attention.ENV_AMX, value)
    query, cache, starts, qlens, ctx, table = prefill_case(
        torch.Generator().manual_seed(4), [(0, 20)], 9, 3, 64, torch.bfloat16
    )
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="WEFT_ATTENTION_AMX must be 0 or 1"):
        cpu_attention.paged_prefill_attention(query, cache, starts, qlens, ctx, table, 0.125, out)
    assert torch.all(out == 0)


@needs_compiler
def test_the_kernel_takes_its_switches_as_arguments_and_reads_no_environment(monkeypatch):
    """The switches reach the ops as arguments (cpu_attention reads them through services/env.py):
    with every one set to a value the wrapper refuses, the ops themselves still run, and give what
    their arguments ask for (here the defaults: an AVX2 build has no other path)."""
    from tests.kernels.prefill_cases import prefill_case

    gen = torch.Generator().manual_seed(11)
    query, cache, token_idx, seq_lens, table = decode_case(gen, [20, 5], 9, 3, 64, torch.bfloat16)
    want = torch.zeros(query.shape, dtype=torch.bfloat16)
    cpu_attention.paged_decode_attention(query, cache, token_idx, seq_lens, table, 0.125, want)
    pq, pcache, starts, qlens, ctx, ptable = prefill_case(gen, [(0, 20)], 9, 3, 64, torch.bfloat16)
    want_prefill = torch.zeros(pq.shape, dtype=torch.bfloat16)
    cpu_attention.paged_prefill_attention(pq, pcache, starts, qlens, ctx, ptable, 0.125, want_prefill)
    for name in (cpu_attention.ENV_BF16_DOT, cpu_attention.ENV_AMX, cpu_attention.ENV_INT8_FAST):
        monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        cpu_attention.decode_switches()
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    torch.ops.weft_cpu.paged_decode_attention(
        query, cache, token_idx, seq_lens, table, 0.125, out, 0, None, False, True
    )
    assert torch.equal(out, want)
    out = torch.zeros(pq.shape, dtype=torch.bfloat16)
    torch.ops.weft_cpu.paged_prefill_attention(
        pq, pcache, starts, qlens, ctx, ptable, 0.125, out, 0, None, False, True
    )
    assert torch.equal(out, want_prefill)
