"""The paged prefill kernel against its own source at a git revision, interleaved call by call.

The baseline (``--baseline``, default ``main``) is built from that revision's
``kernels/csrc/cpu_paged_attention.cpp`` with its ops in ``weft_cpu_base`` and the instruction
set that revision's ``kernels/cpu_attention.py`` asked for (``wide_isa()``: AVX-512 without bf16,
or AVX2); the new kernel is this checkout's, as ``kernels.cpu_attention`` builds it. Calls
alternate (old, new, old, ...) so that load from other work hits both alike; the medians count,
and the fastest calls are shown too (other work on the machine only ever adds time).

Cases are NEW/CONTEXT (one prefill, SmolLM2-135M's heads: 9 query, 3 KV, head size 64, the
blocks shuffled over the cache) or ``mixed:N`` (N fresh prompts of 32..512 tokens in one call, as
a prefill step of the offline workload holds), or ``decode:B/CONTEXT`` (B decodes of the decode
kernel), or ``step:B`` (B decodes as a decode step of the offline workload meets them: 30 layers,
each its own cache, prompts of 32..512 tokens in consecutive blocks and 20..200 generated tokens
in blocks handed out in turn to the B sequences as they grew, 4 MiB read between two layers as
the linear layers do, so that every call starts with its keys out of cache; per-call times).

Usage: ``python benchmarks/scripts/prefill_kernel_vs_baseline.py [--baseline REV] 512/0 64/448 mixed:40 step:32``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import zlib

import torch
from attention_bandwidth import load_baseline  # scripts/ is on the path of a script run

from kernels import cpu_attention
from kernels.cpu_build import amx_isa, bf16_isa, cpu_flags, wide_isa

H, KVH, D, BS = 9, 3, 64, 16


def make_case(lens: list[tuple[int, int]], dtype: torch.dtype, gen: torch.Generator):
    """The kernel's arguments for sequences of (new, context) tokens, blocks shuffled over one cache."""
    per_seq = [-(-(n + c) // BS) for n, c in lens]
    num_blocks = 2 * sum(per_seq) + 8
    cache = torch.randn(2, KVH, num_blocks, BS, D, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(per_seq):
        table[i, :nb] = pool[used : used + nb].to(torch.int32)
        used += nb
    new = [n for n, _ in lens]
    query = torch.randn(sum(new), H, D, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0)[:-1].tolist()])
    return (
        query,
        cache,
        starts,
        torch.tensor(new, dtype=torch.int32),
        torch.tensor([c for _, c in lens], dtype=torch.int32),
        table,
        D**-0.5,
    )


def decode_args(batch: int, context: int, dtype: torch.dtype, gen: torch.Generator):
    """``paged_decode_attention``'s arguments for ``batch`` decodes after ``context`` keys each."""
    query, cache, _, _, _, table, scale = make_case([(1, context)] * batch, dtype, gen)
    lens = torch.full((batch,), context + 1, dtype=torch.int32)
    return query, cache, torch.arange(batch), lens, table, scale


def step_args(batch: int, dtype: torch.dtype, gen: torch.Generator, layers: int = 30):
    """``step:B``: per-layer caches and the shared decode arguments (see the module notes)."""
    prompts = torch.randint(32, 513, (batch,), generator=gen).tolist()
    lens = [p + g for p, g in zip(prompts, torch.randint(20, 201, (batch,), generator=gen).tolist())]
    tables: list[list[int]] = [[] for _ in range(batch)]
    next_block = 1
    for i, prompt in enumerate(prompts):  # a prompt's blocks come together, at its prefill
        tables[i] = list(range(next_block, next_block + -(-prompt // BS)))
        next_block += len(tables[i])
    for t in range(max(lens)):  # then one block at a time, to whichever sequence fills its last
        for i, length in enumerate(lens):
            if t < length and len(tables[i]) * BS <= t:
                tables[i].append(next_block)
                next_block += 1
    table = torch.zeros(batch, max(len(t) for t in tables), dtype=torch.int32)
    for i, blocks in enumerate(tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    caches = [torch.randn(2, KVH, next_block, BS, D, generator=gen).to(dtype) for _ in range(layers)]
    query = torch.randn(batch, H, D, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return caches, (query, torch.arange(batch), seq_lens, table), [(1, n - 1) for n in lens]


def step_runner(op, caches, query, token_idx, seq_lens, table, out, flush: torch.Tensor):
    """A step: one call per layer, ``flush`` (one 4 MiB row per layer) read before each. It
    returns the calls' own seconds, per call (the reads between them not counted)."""

    def run() -> float:
        total = 0.0
        for layer, cache in enumerate(caches):
            flush[layer].sum()
            total += timed(lambda c=cache: op(query, c, token_idx, seq_lens, table, D**-0.5, out, 0))
        return total / len(caches)

    return run


def parse_case(text: str, gen: torch.Generator) -> list[tuple[int, int]]:
    if text.startswith("mixed:"):
        count = int(text.split(":")[1])
        return [(int(n), 0) for n in torch.randint(32, 513, (count,), generator=gen)]
    new, context = (int(x) for x in text.split("/"))
    return [(new, context)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "cases",
        nargs="+",
        help="NEW/CONTEXT, mixed:N, decode:B/CONTEXT or step:B, e.g. 512/0 64/448 mixed:40 step:32",
    )
    parser.add_argument("--baseline", default="main", help="git revision of the old kernel")
    parser.add_argument(
        "--baseline-isa",
        choices=("wide", "bf16"),
        default="wide",
        help="build the baseline as main does (wide_isa: no bf16 instructions) or with bf16_isa, "
        "to compare two versions of the bf16 path",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=21, help="calls of each, alternated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    base_isa = wide_isa() if args.baseline_isa == "wide" else bf16_isa()
    load_baseline(args.baseline, base_isa)
    cpu_attention.load()
    old_op = torch.ops.weft_cpu_base.paged_prefill_attention
    new_op = torch.ops.weft_cpu.paged_prefill_attention
    print(
        f"threads {args.threads}, {args.dtype}, baseline {args.baseline} ({base_isa[0]}) vs this checkout "
        f"({amx_isa()[0]}), {args.rounds} rounds, load average {os.getloadavg()[0]:.2f}, "
        f"avx512_bf16 {'yes' if 'avx512_bf16' in cpu_flags() else 'no'}, "
        f"amx_bf16 {'yes' if 'amx_bf16' in cpu_flags() else 'no'}"
    )
    print(
        "| case | tokens | old ms | new ms | old/new | old min ms | new min ms | min old/new | new GFLOP/s | max diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for text in args.cases:
        gen = torch.Generator().manual_seed(zlib.crc32(text.encode()))  # a case's data: its name alone
        if text.startswith("step:"):  # step:BATCH, the decode kernel in a model step
            caches, (query, token_idx, seq_lens, table), lens = step_args(int(text.split(":")[1]), dtype, gen)
            flush = torch.randn(len(caches), 1 << 20, generator=gen)
            out_old, out_new = torch.empty_like(query), torch.empty_like(query)
            ops = (torch.ops.weft_cpu_base.paged_decode_attention, torch.ops.weft_cpu.paged_decode_attention)
            old = step_runner(ops[0], caches, query, token_idx, seq_lens, table, out_old, flush)
            new = step_runner(ops[1], caches, query, token_idx, seq_lens, table, out_new, flush)
            old(), new()  # warm-up
            a, b = [], []
            for _ in range(args.rounds):
                a.append(old())
                b.append(new())
            report(text, lens, a, b, out_old, out_new)
            continue
        if text.startswith("decode:"):  # decode:BATCH/CONTEXT, the decode kernel
            batch, context = (int(x) for x in text.split(":")[1].split("/"))
            lens = [(1, context)] * batch
            *kargs, scale = decode_args(batch, context, dtype, gen)
            ops = (torch.ops.weft_cpu_base.paged_decode_attention, torch.ops.weft_cpu.paged_decode_attention)
        else:
            lens = parse_case(text, gen)
            *kargs, scale = make_case(lens, dtype, gen)
            ops = (old_op, new_op)
        out_old, out_new = torch.empty_like(kargs[0]), torch.empty_like(kargs[0])
        old = functools.partial(ops[0], *kargs, scale, out_old, 0)
        new = functools.partial(ops[1], *kargs, scale, out_new, 0)
        old(), new()  # warm-up
        a, b = [], []
        for _ in range(args.rounds):
            a.append(timed(old))
            b.append(timed(new))
        report(text, lens, a, b, out_old, out_new)


def report(text: str, lens, a: list[float], b: list[float], out_old, out_new) -> None:
    t_old, t_new = statistics.median(a), statistics.median(b)
    f_old, f_new = min(a), min(b)
    # 4 D flops per causal (query head, key) pair: a multiply-add each for the score and the value.
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in lens) * H
    diff = (out_old.float() - out_new.float()).abs().max().item()
    print(
        f"| {text} | {sum(n for n, _ in lens)} | {t_old * 1e3:.3f} | {t_new * 1e3:.3f} | {t_old / t_new:.2f}x "
        f"| {f_old * 1e3:.3f} | {f_new * 1e3:.3f} | {f_old / f_new:.2f}x | {4 * D * pairs / t_new / 1e9:.0f} "
        f"| {diff:.3g} |"
    )


if __name__ == "__main__":
    main()
