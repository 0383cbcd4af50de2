"""KV blocks one long request holds, with and without window-aware freeing.

Runs the engine's own KV cache manager (no model): a request with a
``--prompt``-token prompt prefilled in ``--chunk``-token steps, then decoded
token by token to ``--length``; after each step, the blocks it holds are
counted (every KV cache group, null entries excluded). The layout is
Gemma 3's: 3 global + 15 window layers -> 1 full group + 5 window groups.

Usage: ``python benchmarks/scripts/window_blocks.py [--length 8192] [--window 512] ...``
"""

from __future__ import annotations

import argparse

from protocol import SamplingParams
from protocol.kv_cache_groups import kv_cache_groups
from services.engine_core.kv_cache_manager import KVCacheManager
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request


def peak_blocks(
    length: int, prompt: int, chunk: int, window: int, block_size: int, free: bool
) -> tuple[int, int]:
    """(blocks held at the end, the most held at once)."""
    windows = [0 if (i + 1) % 6 == 0 else window for i in range(18)]
    groups = [g.window for g in kv_cache_groups(windows, 18)]
    kv = KVCacheManager(
        1 << 20, block_size, True, max_model_len=length + 1, group_windows=groups, free_out_of_window=free
    )
    r = Request("r", list(range(prompt)), SamplingParams(), 0.0, block_hasher=make_block_hasher(block_size))
    peak = 0
    while r.num_computed_tokens < length:
        if r.num_computed_tokens >= prompt:
            r.append_output_token_ids(1)
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        peak = max(peak, kv.num_held_blocks("r"))
    return kv.num_held_blocks("r"), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096, 8192, 32768])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    # One block holds a group's 3 layers: 3 x 2 (K, V) x block_size x 1 KV head x 256 x 4 bytes (fp32).
    block_mib = 3 * 2 * args.block_size * 256 * 4 / 2**20
    print("| tokens | blocks held, all kept | window-aware (peak) | KV MiB fp32, all kept | window-aware |")
    print("|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        kept, _ = peak_blocks(length, args.prompt, args.chunk, args.window, args.block_size, free=False)
        freed, peak = peak_blocks(length, args.prompt, args.chunk, args.window, args.block_size, free=True)
        print(f"| {length} | {kept} | {freed} ({peak}) | {kept * block_mib:.1f} | {freed * block_mib:.1f} |")


if __name__ == "__main__":
    main()
