"""Time the compiled element-wise passes around the int8 GEMMs of one SmolLM2 MLP.

    python benchmarks/scripts/fused_passes_bench.py --rows 1839 48 --threads 2

For each row count (1,839: a prefill step of offline-64; 48: a decode step), on random bf16
inputs of the default model's MLP shapes (gate/up 2 x 1,536 columns from a 576-wide row):

- ``quantize 576`` / ``quantize 1536``: ``quantize_rows_int8`` (rotate and round) of a
  576- and a 1,536-wide row, the inputs of gate/up and of down;
- ``scale_int32``: the gate/up GEMM's int32 result scaled back to bf16;
- ``silu_and_mul``: SiLU-and-mul of that;
- ``three passes``: the three one after the other, from the int32 result to down's int8 input;
- ``one pass``: ``scale_silu_quantize_int8``, the same numbers in one kernel (where this
  checkout has it).

Every case runs ``--calls`` times per round and the rounds alternate the cases, so a load
change on a shared machine hits them alike; the best round of each counts. Run it from two
checkouts (each with its own ``TORCH_EXTENSIONS_DIR``) to compare their kernels.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kernels import cpu_fused

HIDDEN, INTERMEDIATE = 576, 1536


def cases(rows: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    acc = torch.randint(-(2**20), 2**20, (rows, 2 * INTERMEDIATE), dtype=torch.int32, generator=gen)
    row_scale = torch.rand(rows, generator=gen) * 1e-3 + 1e-4
    col_scale = torch.rand(2 * INTERMEDIATE, generator=gen) * 1e-2
    x = (torch.randn(rows, HIDDEN, generator=gen) * 3).to(torch.bfloat16)
    gate_up = cpu_fused.scale_int32(acc, row_scale, col_scale, None, torch.bfloat16)
    act = cpu_fused.silu_and_mul(gate_up)

    def three_passes():
        scaled = cpu_fused.scale_int32(acc, row_scale, col_scale, None, torch.bfloat16)
        return cpu_fused.quantize_rows_int8(cpu_fused.silu_and_mul(scaled), 64)

    timed = {
        "quantize 576": lambda: cpu_fused.quantize_rows_int8(x, 64),
        "quantize 1536": lambda: cpu_fused.quantize_rows_int8(act, 64),
        "scale_int32": lambda: cpu_fused.scale_int32(acc, row_scale, col_scale, None, torch.bfloat16),
        "silu_and_mul": lambda: cpu_fused.silu_and_mul(gate_up),
        "three passes": three_passes,
    }
    if hasattr(cpu_fused, "scale_silu_quantize_int8"):
        timed["one pass"] = lambda: cpu_fused.scale_silu_quantize_int8(
            acc, row_scale, col_scale, 64, torch.bfloat16
        )
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1839, 48])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    if min(args.rows) < 1 or args.threads < 1 or args.rounds < 1 or args.calls < 1:
        parser.error("--rows, --threads, --rounds and --calls must be positive")
    if not cpu_fused.available():
        raise SystemExit("the fused CPU kernels are not available here (see the log above)")
    torch.set_num_threads(args.threads)
    print(
        f"threads {args.threads}, bf16, load average {os.getloadavg()[0]:.2f}, best of {args.rounds} rounds"
    )
    for rows in args.rows:
        timed = cases(rows)
        best = dict.fromkeys(timed, float("inf"))
        for fn in timed.values():
            fn()  # warm: first-touch allocations, caches
        for _ in range(args.rounds):
            for name, fn in timed.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - start) / args.calls * 1e3)
        line = ", ".join(f"{name} {ms:.3f} ms" for name, ms in best.items())
        ratio = f"; one pass {best['three passes'] / best['one pass']:.2f}x" if "one pass" in best else ""
        print(f"{rows} rows: {line}{ratio}")


if __name__ == "__main__":
    main()
