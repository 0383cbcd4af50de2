"""CPU attention against the machine's memory bandwidth, old kernels against new, in one run.

Measures, interleaved round by round (baseline, new, baseline, new, ...):

- the machine's sequential read bandwidth: ``torch.sum`` over a 1 GiB fp32 tensor, all threads;
- decode attention (``paged_decode_attention``) at batch 1 and 64, SmolLM2-135M's heads (9 query,
  3 KV, head size 64), keys in blocks scattered over the cache: the new kernel against the one
  at ``--baseline`` (a git revision, built from its source under its own op namespace);
- the same decode at batch 1 as a model step meets it (``--layered``): 30 layers' caches, and
  4 MiB read between two calls, as the linear layers do, so each call starts out of cache;
- prefills of some new tokens after a cached context (``--prefill``): the paged prefill kernel
  against the torch path (``prefill_attention``: the context copied out of the cache, then
  SDPA), which the engine keeps for fresh prompts past ``FP32_PREFILL_CAPS`` on the fp32 path.

Effective bandwidth = the K/V bytes the attention must read (each cached key and value once)
/ time; the fraction is of the read bandwidth measured in the same round.

Usage: ``python benchmarks/scripts/attention_bandwidth.py [--rounds 5] [--dtype float32|bfloat16]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kernels import cpu_attention
from kernels.cpu_build import build, cpu_flags
from services.worker.layers.attention import prefill_attention
from services.worker.layers.attention_metadata import PrefillSeq

H, KVH, D, BS = 9, 3, 64, 16
REPO = Path(__file__).resolve().parents[2]


def load_baseline(rev: str, isa: tuple[str, list[str]] | None = None) -> str:
    """Build the attention kernel at git revision ``rev`` (for ``isa``; default: the build's default)
    with its ops in ``torch.ops.weft_cpu_base``; returns that namespace."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True
        ).stdout

    source = git("show", f"{rev}:kernels/csrc/cpu_paged_attention.cpp")
    source = source.replace("TORCH_LIBRARY(weft_cpu,", "TORCH_LIBRARY(weft_cpu_base,")
    path = Path(tempfile.mkdtemp()) / "cpu_paged_attention_base.cpp"
    path.write_text(source)
    commit = git("rev-parse", rev).strip()
    build(
        f"weft_attention_base_{commit[:12]}",
        path,
        f"the attention kernel at {rev}",
        **({"isa": isa} if isa else {}),
    )
    return "weft_cpu_base"


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm: caches, page faults, the thread pool
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(buffer: torch.Tensor, repeats: int) -> float:
    """Bytes per second of a sequential read of ``buffer`` (all threads)."""
    return buffer.numel() * buffer.element_size() / best_seconds(lambda: buffer.sum(), repeats)


def decode_case(batch: int, context: int, dtype: torch.dtype, gen: torch.Generator, shuffled: bool = True):
    """``batch`` decodes of ``context`` keys each, their blocks in random places of one cache
    (``shuffled``), or each sequence's blocks one after another, as a fresh block pool hands
    out a prompt's blocks."""
    per_seq = -(-context // BS)
    num_blocks = batch * per_seq + 1
    order = torch.randperm(num_blocks - 1, generator=gen) if shuffled else torch.arange(num_blocks - 1)
    table = (order + 1).to(torch.int32).view(batch, per_seq)
    cache = torch.randn(2, KVH, num_blocks, BS, D, generator=gen).to(dtype)
    query = torch.randn(batch, H, D, generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    kv_bytes = 2 * batch * context * KVH * D * cache.element_size()
    return (query, cache, torch.arange(batch), lens, table, D**-0.5, torch.empty_like(query)), kv_bytes


def decode_runner(namespace: str, args):
    op = getattr(torch.ops, namespace).paged_decode_attention
    return lambda: op(*args)


def layered_decode(base: str, context: int, dtype: torch.dtype, gen: torch.Generator, repeats: int):
    """Batch-1 decode as a model step meets it: 30 layers, each its own cache, and 4 MiB of
    "weights" read between two calls (the linear layers), so that each call starts with its
    blocks out of cache and TLB. Returns seconds per call, old and new."""
    (query, _, token_idx, lens, table, scale, out), _ = decode_case(1, context, dtype, gen, shuffled=False)
    caches = [torch.randn(2, KVH, 4000, BS, D, generator=gen).to(dtype) for _ in range(30)]
    table = table + 100
    weights = torch.randn(30, 1 << 20, generator=gen)

    def step(namespace: str) -> float:
        op, total = getattr(torch.ops, namespace).paged_decode_attention, 0.0
        for layer, cache in enumerate(caches):
            weights[layer].sum()
            start = time.perf_counter()
            op(query, cache, token_idx, lens, table, scale, out, 0)
            total += time.perf_counter() - start
        return total / len(caches)

    old = min(step(base) for _ in range(repeats))
    return old, min(step("weft_cpu") for _ in range(repeats))


def prefill_case(tokens: int, context: int, dtype: torch.dtype, gen: torch.Generator):
    """One sequence: ``tokens`` new tokens after ``context`` cached ones, all in the cache."""
    total = context + tokens
    nb = -(-total // BS)
    blocks = torch.randperm(nb + 1, generator=gen)[:nb] + 0
    cache = torch.randn(2, KVH, nb + 1, BS, D, generator=gen).to(dtype)
    query = torch.randn(tokens, H, D, generator=gen).to(dtype)
    rows = cache.view(2, KVH, -1, D)
    slots = (blocks[:, None] * BS + torch.arange(BS)).reshape(-1)[context:total]
    key, value = rows[0][:, slots].transpose(0, 1), rows[1][:, slots].transpose(0, 1)  # [n, KVH, D]
    flops = 4 * H * D * (tokens * context + tokens * (tokens + 1) // 2)
    kv_bytes = 2 * total * KVH * D * cache.element_size()
    new = (
        query,
        cache,
        torch.tensor([0]),
        torch.tensor([tokens], dtype=torch.int32),
        torch.tensor([context], dtype=torch.int32),
        blocks.to(torch.int32)[None],
        D**-0.5,
        torch.empty_like(query),
    )
    seq = _prefill_seq(tokens, context, blocks)
    old = (query, key.contiguous(), value.contiguous(), cache, seq, D**-0.5)
    return new, old, kv_bytes, flops


def _prefill_seq(tokens: int, context: int, blocks: torch.Tensor) -> PrefillSeq:
    if context == 0:
        return PrefillSeq(0, tokens, 0, None, None)
    query_pos = context + torch.arange(tokens)[:, None]
    return PrefillSeq(0, tokens, context, blocks, torch.arange(context + tokens)[None, :] <= query_pos)


def run(args) -> None:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    cpu_attention.load()
    base = load_baseline(args.baseline)
    buffer = torch.ones(1 << 28)  # 1 GiB of fp32
    decodes = {
        f"decode b={b} ctx={c}{' shuffled' if shuffled else ''}": decode_case(b, c, dtype, gen, shuffled)
        for b, c in args.decode
        for shuffled in (False, True)
    }
    prefills = {f"prefill {t} after {c}": prefill_case(t, c, dtype, gen) for t, c in args.prefill}
    rows: dict[str, list] = {}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        bandwidth = read_bandwidth(buffer, args.repeats)
        rows.setdefault("read bandwidth", []).append((bandwidth, bandwidth))
        for name, (kernel_args, kv_bytes) in decodes.items():
            old = best_seconds(decode_runner(base, kernel_args), args.repeats)
            new = best_seconds(decode_runner("weft_cpu", kernel_args), args.repeats)
            rows.setdefault(name, []).append(
                (kv_bytes / old / bandwidth, kv_bytes / new / bandwidth, old, new, None, kv_bytes)
            )
        for context in args.layered:
            old, new = layered_decode(base, context, dtype, gen, max(1, args.repeats // 4))
            kv_bytes = 2 * context * KVH * D * dtype.itemsize
            rows.setdefault(f"decode b=1 ctx={context}, 30 layers", []).append(
                (kv_bytes / old / bandwidth, kv_bytes / new / bandwidth, old, new, None, kv_bytes)
            )
        for name, (new_args, old_args, kv_bytes, flops) in prefills.items():
            # Long prefills take 0.1-0.2 s a call: fewer repeats. Short ones get them all, since a
            # call of a few µs is easily caught by a stall of the shared machine.
            repeats = args.repeats if new_args[0].shape[0] <= 64 else max(1, args.repeats // 4)
            old = best_seconds(lambda a=old_args: prefill_attention(*a), repeats)
            new = best_seconds(lambda a=new_args: torch.ops.weft_cpu.paged_prefill_attention(*a), repeats)
            rows.setdefault(name, []).append(
                (kv_bytes / old / bandwidth, kv_bytes / new / bandwidth, old, new, flops, kv_bytes)
            )
    print(report(rows, args, (load_before, os.getloadavg()[0])))


def report(rows: dict[str, list], args, load: tuple[float, float]) -> str:
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))))
    bandwidth = statistics.median(r[0] for r in rows["read bandwidth"]) / 1e9
    lines = [
        f"threads {torch.get_num_threads()}, dtype {args.dtype}, baseline {args.baseline}, {args.rounds} rounds, "
        f"load average {load[0]:.1f} -> {load[1]:.1f}",
        f"CPU flags: {flags}",
        f"read bandwidth (median of rounds): {bandwidth:.1f} GB/s",
        "old: decodes, the kernel at the baseline revision; prefills, copy + SDPA (kept for long prefills)",
        "",
        "| case | K/V MiB | old ms | new ms | new/old speed | old % of read bw | new % of read bw | new GFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, samples in rows.items():
        if name == "read bandwidth":
            continue
        old_frac, new_frac, old, new = (statistics.median(s[i] for s in samples) for i in range(4))
        flops, kv_bytes = samples[0][4], samples[0][5]
        gflops = "-" if flops is None else f"{flops / new / 1e9:.1f}"
        lines.append(
            f"| {name} | {kv_bytes / 2**20:.1f} | {old * 1e3:.3f} | {new * 1e3:.3f} | {old / new:.2f}x "
            f"| {old_frac:.0%} | {new_frac:.0%} | {gflops} |"
        )
    return "\n".join(lines)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in pair.split("x")) for pair in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20, help="calls per measurement; the fastest counts")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--baseline", default="b7694ed", help="git revision of the old decode kernel")
    parser.add_argument(
        "--decode",
        type=parse_pairs,
        default=parse_pairs("1x256,1x2048,64x256,64x2048"),
        help="BATCHxCONTEXT,...",
    )
    parser.add_argument(
        "--prefill",
        type=parse_pairs,
        default=parse_pairs("2048x0,512x1536,64x1984,16x2000,5x2000,64x0,16x0"),
        help="NEWxCONTEXT,...: new tokens after cached ones",
    )
    parser.add_argument(
        "--layered",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[160, 1024],
        help="contexts of the batch-1 decode run as a model step (30 layers' caches, reads between calls)",
    )
    parser.add_argument("--threads", type=int, default=0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
