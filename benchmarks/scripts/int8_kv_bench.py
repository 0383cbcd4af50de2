"""Decode and prefill attention over an int8 KV cache (fp32 scales per token and KV head) against a
bf16 one, in the compiled CPU kernels (``kernels/csrc/cpu_paged_attention.cpp``).

SmolLM2-135M's heads (9 query, 3 KV, head size 64), blocks of 128 tokens. Decodes: every round
draws each sequence's blocks afresh, in random order, from a pool several times the size of the
L3, so that each call reads its keys and values from memory, as a model step meets them; the best
of ``--rounds`` is kept. Paths: bf16 cache on bf16 dot products (where the CPU has AVX512_BF16),
int8 cache on the AVX-512 int8 path, and int8 on the generic path (``WEFT_ATTENTION_INT8_FAST=0``).
GB/s = the bytes of K and V (and, for int8, their scales) the call must read / its time.
Prefills (fresh prompts, the cache in place), bf16 queries: bf16 and int8 caches, on bf16 dot
products and on the fp32 path (``WEFT_ATTENTION_BF16_DOT=0``).

Usage: ``python benchmarks/scripts/int8_kv_bench.py [--rounds 20] [--threads 2] [--pool-mib 512]``
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kernels import cpu_attention

H, KVH, D, BS = 9, 3, 64, 128
SCALE = D**-0.5


def pools(pool_mib: int, gen: torch.Generator):
    """A bf16 cache of about ``pool_mib`` MiB, and an int8 cache (with scales) of as many blocks."""
    num_blocks = pool_mib * 2**20 // (2 * KVH * BS * D * 2)
    bf16 = torch.randn(2, KVH, num_blocks, BS, D, generator=gen).bfloat16()
    int8 = torch.randint(-127, 128, bf16.shape, generator=gen, dtype=torch.int8)
    scales = torch.rand(2, KVH, num_blocks, BS, generator=gen) * 0.02
    return bf16, int8, scales, num_blocks


def random_table(batch: int, seq_len: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    per_seq = -(-seq_len // BS)
    return torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).int()


def env_set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def time_decode(batch, seq_len, cache, scales, num_blocks, rounds, gen) -> float:
    query = torch.randn(batch, H, D, generator=gen).bfloat16()
    out = torch.empty_like(query)
    token_idx = torch.arange(batch)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    best = float("inf")
    for _ in range(rounds + 1):  # the first warms the thread pool and the code
        table = random_table(batch, seq_len, num_blocks, gen)
        start = time.perf_counter()
        cpu_attention.paged_decode_attention(
            query, cache, token_idx, seq_lens, table, SCALE, out, check=False, kv_scales=scales
        )
        best = min(best, time.perf_counter() - start)
    return best


def time_prefill(prompts, tokens, cache, scales, num_blocks, rounds, gen) -> float:
    query = torch.randn(prompts * tokens, H, D, generator=gen).bfloat16()
    out = torch.empty_like(query)
    starts = torch.arange(prompts) * tokens
    qlens = torch.full((prompts,), tokens, dtype=torch.int32)
    ctx = torch.zeros(prompts, dtype=torch.int32)
    best = float("inf")
    for _ in range(rounds + 1):
        table = random_table(prompts, tokens, num_blocks, gen)
        start = time.perf_counter()
        cpu_attention.paged_prefill_attention(
            query, cache, starts, qlens, ctx, table, SCALE, out, check=False, kv_scales=scales
        )
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pool-mib", type=int, default=512, help="the bf16 pool's size (int8: half)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_attention.load()
    gen = torch.Generator().manual_seed(0)
    bf16, int8, scales, num_blocks = pools(args.pool_mib, gen)
    print(f"{num_blocks} blocks of {BS} tokens, {args.threads} threads, best of {args.rounds}")

    # (name, cache, scales, the int8 switch, bytes read per K or V row)
    decode_paths = (
        ("bf16 (bf16 dot)", bf16, None, None, 2 * D),
        ("int8 (fast)", int8, scales, "1", D + 4),
        ("int8 (generic)", int8, scales, "0", D + 4),
    )
    for batch, seq_len in ((32, 384), (1, 2048)):
        rows = batch * seq_len * KVH * 2  # K and V rows read
        print(f"decode, {batch} x {seq_len} keys:")
        base = None
        for name, cache, cache_scales, switch, row_bytes in decode_paths:
            env_set(cpu_attention.ENV_INT8_FAST, switch)
            seconds = time_decode(batch, seq_len, cache, cache_scales, num_blocks, args.rounds, gen)
            base = base or seconds
            gbs = rows * row_bytes / seconds / 1e9
            print(f"  {name:16s} {seconds * 1e3:8.3f} ms  {gbs:6.2f} GB/s  {seconds / base:5.2f}x bf16")
    env_set(cpu_attention.ENV_INT8_FAST, None)

    # (name, cache, scales, the bf16-dot switch)
    prefill_paths = (
        ("bf16 (bf16 dot)", bf16, None, None),
        ("bf16 (fp32 path)", bf16, None, "0"),
        ("int8 (bf16 dot)", int8, scales, None),
        ("int8 (fp32 path)", int8, scales, "0"),
    )
    for prompts, tokens in ((48, 40), (1, 2048)):
        print(f"prefill, {prompts} x {tokens} fresh tokens:")
        base = None
        for name, cache, cache_scales, switch in prefill_paths:
            env_set(cpu_attention.ENV_BF16_DOT, switch)
            seconds = time_prefill(prompts, tokens, cache, cache_scales, num_blocks, args.rounds, gen)
            base = base or seconds
            print(f"  {name:16s} {seconds * 1e3:8.3f} ms  {seconds / base:5.2f}x bf16")
        env_set(cpu_attention.ENV_BF16_DOT, None)


if __name__ == "__main__":
    main()
