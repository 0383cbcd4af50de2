"""The paged prefill kernel against the torch path (SDPA) on single prefills, interleaved call by call.

Each case is NEW/CONTEXT: NEW tokens after CONTEXT cached ones, SmolLM2-135M's heads (9 query,
3 KV, head size 64), the sequence's blocks shuffled over the cache. The kernel reads everything
from the cache; the torch path is what the engine runs for prefills above the kernel's caps
(``prefill_attention``: SDPA on the step's own K/V for a fresh prompt, the context copied out of
the cache plus a mask otherwise). Calls alternate (kernel, SDPA, kernel, ...); the medians count.

Run it from two checkouts (each with its own ``TORCH_EXTENSIONS_DIR``) to compare kernels.

Usage: ``python benchmarks/scripts/prefill_kernel_vs_sdpa.py [--threads 2] [--dtype bfloat16] 512/0 16/2000 ...``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from kernels import cpu_attention
from services.worker.layers.attention import prefill_attention
from services.worker.layers.attention_metadata import PrefillSeq

H, KVH, D, BS = 9, 3, 64, 16


def case(new: int, context: int, dtype: torch.dtype, gen: torch.Generator):
    total = context + new
    nb = -(-total // BS)
    num_blocks = 3 * nb + 8
    cache = torch.randn(2, KVH, num_blocks, BS, D, generator=gen).to(dtype)
    blocks = torch.randperm(num_blocks, generator=gen)[:nb].to(torch.int32)
    query = torch.randn(new, H, D, generator=gen).to(dtype)
    rows = cache.view(2, KVH, -1, D)
    slots = (blocks.long()[:, None] * BS + torch.arange(BS)).reshape(-1)[context:total]
    key, value = rows[0][:, slots].transpose(0, 1), rows[1][:, slots].transpose(0, 1)  # [new, KVH, D]
    if context:
        mask = np.arange(total)[None, :] <= context + np.arange(new)[:, None]
        seq = PrefillSeq(0, new, context, blocks.long(), torch.from_numpy(mask))
    else:
        seq = PrefillSeq(0, new, 0, None, None)
    kernel_args = (
        query,
        cache,
        torch.tensor([0]),
        torch.tensor([new], dtype=torch.int32),
        torch.tensor([context], dtype=torch.int32),
        blocks[None].contiguous(),
        D**-0.5,
        torch.empty_like(query),
    )
    return kernel_args, (query, key, value, cache, seq, D**-0.5)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(new: int, context: int, dtype: torch.dtype, rounds: int) -> tuple[float, float, float]:
    """(kernel ms, SDPA path ms, largest difference of their outputs)."""
    kernel_args, torch_args = case(new, context, dtype, torch.Generator().manual_seed(new + context))
    kernel = lambda: cpu_attention.paged_prefill_attention(*kernel_args)  # noqa: E731
    sdpa = lambda: prefill_attention(*torch_args)  # noqa: E731
    kernel(), sdpa()  # warm-up
    a, b = [], []
    for _ in range(rounds):
        a.append(timed(kernel))
        b.append(timed(sdpa))
    error = (kernel_args[-1].float() - sdpa().float()).abs().max().item()
    return statistics.median(a) * 1e3, statistics.median(b) * 1e3, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help="NEW/CONTEXT, e.g. 512/0 16/2000")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=11, help="calls of each, alternated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"threads {args.threads}, {args.dtype}, load average {os.getloadavg()[0]:.2f}")
    for text in args.cases:
        new, context = (int(x) for x in text.split("/"))
        k, s, error = measure(new, context, dtype, args.rounds)
        print(
            f"new {new:>5} after {context:>5}: kernel {k:8.3f} ms  SDPA path {s:8.3f} ms  "
            f"kernel {s / k:.2f}x  max |diff| {error:.2g}"
        )


if __name__ == "__main__":
    main()
