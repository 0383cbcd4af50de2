"""Every weight matmul of one forward of the default model at M rows: packed kernels vs the dense copy.

    python scripts/dense_rows_bench.py --rows 1 4 8 16 64 256 --threads 2

For each row count, runs each linear layer and the LM head once on random
inputs, three ways, alternated over ``--rounds`` (packed, bf16, fp32, packed,
...) so a load change on a shared machine hits all three, and prints the best
time of each:

- ``packed``: the weights kept quantized, through the packed kernels (the
  path of steps under ``--dense-min-rows`` rows),
- ``bf16`` / ``fp32``: the dense copy in that dtype, packed for oneDNN as the
  CPU worker packs it (the path from ``--dense-min-rows`` rows on).

The row count from which the dense copy wins on every layer is what
``services/config/dense_copy.DEFAULT_DENSE_MIN_ROWS`` is set from.
"""

from __future__ import annotations

import argparse
import time

import torch

from services.config.engine_args import EngineArgs
from services.worker.layers.linear import LinearBase
from services.worker.model_loader import load_model

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def kept_quantized_layers():
    """The default model's linear layers with their packed weights (a tied head counted once)."""
    config = EngineArgs(device="cpu", dtype="float32", dense_min_rows=0).create_engine_config().model
    seen, layers = set(), []
    for module in load_model(config).modules():
        if isinstance(module, LinearBase) and module.quant is not None and id(module.quant) not in seen:
            seen.add(id(module.quant))
            layers.append(module.quant)
    return layers


def dense_copies(layers, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.ops.mkldnn._reorder_linear_weight(q.dequantize().to(dtype), 64) for q in layers]


@torch.inference_mode()
def time_forward(layers, copies, rows: int, dtype: torch.dtype | None, repeats: int) -> float:
    """Best of ``repeats`` over all layers; ``copies`` None runs the packed kernels."""
    xs = [torch.randn(rows, q.shape[1], dtype=dtype or torch.float32) for q in layers]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i, q in enumerate(layers):
            if copies is None:
                q.linear(xs[i], None)
            else:
                torch.ops.mkldnn._linear_pointwise(xs[i], copies[i], None, "none", [], "")
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = kept_quantized_layers()
    copies = {name: dense_copies(layers, dtype) for name, dtype in DTYPES.items()}
    print(f"{len(layers)} weight matrices, {args.threads} threads; ms for all of them, best of each")
    print(f"{'rows':>6} {'packed':>9} {'bf16':>9} {'fp32':>9}  packed/bf16  packed/fp32")
    for rows in args.rows:
        best = {"packed": float("inf")} | {name: float("inf") for name in DTYPES}
        for _ in range(args.rounds):
            best["packed"] = min(best["packed"], time_forward(layers, None, rows, None, args.repeats))
            for name, dtype in DTYPES.items():
                best[name] = min(best[name], time_forward(layers, copies[name], rows, dtype, args.repeats))
        ms = {k: v * 1e3 for k, v in best.items()}
        print(
            f"{rows:6d} {ms['packed']:9.1f} {ms['bf16']:9.1f} {ms['fp32']:9.1f}"
            f"  {ms['packed'] / ms['bf16']:10.2f}x {ms['packed'] / ms['fp32']:10.2f}x"
        )


if __name__ == "__main__":
    main()
