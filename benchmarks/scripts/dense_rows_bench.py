"""Every weight matmul of one forward of the default model at M rows: packed kernels vs the dense copies.

    python benchmarks/scripts/dense_rows_bench.py --rows 1 4 8 16 64 256 --threads 2

For each row count, runs each linear layer and the LM head once on random
inputs, four ways, alternated over ``--rounds`` (packed, bf16, fp32, int8,
packed, ...) so a load change on a shared machine hits all of them, and prints
the best time of each:

- ``packed``: the weights kept quantized, through the packed kernels (the
  path of steps under ``--dense-min-rows`` rows),
- ``bf16`` / ``fp32``: the dense copy in that dtype, packed for oneDNN as the
  CPU worker packs it (the path from ``--dense-min-rows`` rows on),
- ``int8``: the int8 copy (``--dense-copy-dtype int8``) on bf16 activations:
  rows rotated and rounded, the integer GEMM the CPU gets by default
  (``int8_linear.default_int8_gemm``: weft's own on AMX int8 tiles or AVX-512
  VNNI, ``torch._int_mm`` elsewhere), scaled back,
- ``int8-fp32``: the same on fp32 activations (dtype auto's on a CPU without bf16 math; on weft's
  AVX2 GEMM one call a layer: ``Int8Weight.one_call``),
- ``int8-mm``: the same with ``torch._int_mm`` whatever the CPU,
- ``int8-onednn``: the same with oneDNN's int8 matmul (slow without AMX).

``--paths`` picks the columns (all by default).

The row count from which the dense copy wins on every layer is what
``services/config/dense_copy.DEFAULT_DENSE_MIN_ROWS`` is set from.
"""

from __future__ import annotations

import argparse
import time

import torch

from services.config.engine_args import EngineArgs
from services.worker.layers.int8_linear import Int8Weight, default_int8_gemm
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


def matmuls(layers, name: str) -> tuple[list, torch.dtype]:
    """One ``x -> x W^T`` per layer for path ``name``, and the dtype of its x."""
    if name == "packed":
        return [lambda x, q=q: q.linear(x, None) for q in layers], torch.float32
    if name in ("int8", "int8-fp32", "int8-mm", "int8-onednn"):
        gemm = {"int8-mm": "int_mm", "int8-onednn": "onednn"}.get(name)
        copies = [Int8Weight(q.dequantize(), gemm=gemm) for q in layers]
        dtype = torch.float32 if name == "int8-fp32" else torch.bfloat16
        return [lambda x, w=w: w.linear(x, None) for w in copies], dtype
    copies = dense_copies(layers, DTYPES[name])
    pointwise = torch.ops.mkldnn._linear_pointwise
    return [lambda x, c=c: pointwise(x, c, None, "none", [], "") for c in copies], DTYPES[name]


@torch.inference_mode()
def time_forward(layers, path: tuple[list, torch.dtype], rows: int, repeats: int) -> float:
    """Best of ``repeats`` over all layers."""
    calls, dtype = path
    xs = [torch.randn(rows, q.shape[1], dtype=dtype) for q in layers]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for call, x in zip(calls, xs):
            call(x)
        best = min(best, time.perf_counter() - start)
    return best


PATHS = ("packed", "bf16", "fp32", "int8", "int8-fp32", "int8-mm", "int8-onednn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="The columns to time.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = kept_quantized_layers()
    paths = {name: matmuls(layers, name) for name in args.paths}
    print(f"{len(layers)} weight matrices, {args.threads} threads; ms for all of them, best of each")
    print(f"int8: the {default_int8_gemm()} GEMM; int8-mm: torch._int_mm; int8-onednn: oneDNN's int8 matmul")
    print(f"{'rows':>6} " + " ".join(f"{name:>11}" for name in paths))
    for rows in args.rows:
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(args.rounds):
            for name, path in paths.items():
                best[name] = min(best[name], time_forward(layers, path, rows, args.repeats))
        print(f"{rows:6d} " + " ".join(f"{best[name] * 1e3:11.1f}" for name in paths), flush=True)


if __name__ == "__main__":
    main()
