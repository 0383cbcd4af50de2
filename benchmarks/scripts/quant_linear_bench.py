"""Time every weight matmul of one forward of the default model, kept quantized vs dequantized.

    python benchmarks/scripts/quant_linear_bench.py --rows 1 64 --threads 1 2

For each thread count and row count (1: a batch-1 decode step; 64: a decode
step of 64 requests), runs each linear layer and the LM head once on random
inputs and prints the best of ``--repeats`` times of each variant:

- ``old``: the quantized model on the AVX2 build with fp32 activations (the
  kernel before int8 activations),
- ``int16``: the default build (AVX-512 VNNI where the CPU has it) with
  int16 activations (``WEFT_QUANT_ACTIVATIONS=int16``, opt-in),
- ``i16rw``: the same, one row of x taken against W row by row (the loop
  before batch-1 steps took four weight rows at a time),
- ``int8``: the default build with int8 activations (the default),
- ``dense``: the dequantized model through the oneDNN-packed fp32 weights the
  CPU worker uses.

The quantized variants alternate (old, int16, i16rw, int8, old, ...) over ``--rounds``
so a load change on a shared machine hits both. Alongside, the bytes of
weights each read per step over that time, and the machine's read bandwidth
measured here with the same number of threads (a sum over a buffer much
larger than the caches), so each figure is also a fraction of the
weight-read bound.
"""

from __future__ import annotations

import argparse
import time

import msgspec
import torch

from kernels.cpu_quant_linear import set_single_row_blocks
from services.config.engine_args import EngineArgs
from services.worker.layers.linear import LinearBase, pack_linear_weights
from services.worker.layers.quantized_linear import activations_from_env, choose_kernel
from services.worker.model_loader import load_model


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second a sum over ``nbytes`` of fp32 reads (best of ``repeats``)."""
    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def layer_inputs(model, rows: int) -> list[tuple[LinearBase, torch.Tensor]]:
    """One random input per weight matrix (a tied head counted once)."""
    seen, inputs = set(), []
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        weight = module.quant if module.quant is not None else module.packed_weight
        if id(weight) in seen:
            continue
        seen.add(id(weight))
        in_features = module.quant.shape[1] if module.quant is not None else module.packed_weight.size(1)
        inputs.append((module, torch.randn(rows, in_features)))
    return inputs


def weight_bytes(inputs) -> int:
    """Bytes of the weights ``inputs`` read: packed, or fp32 for the dequantized model."""
    total = 0
    for module, _ in inputs:
        packed = module.packed_weight
        total += module.quant.nbytes if module.quant is not None else packed.size(0) * packed.size(1) * 4
    return total


@torch.inference_mode()
def time_step(inputs, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for module, x in inputs:
            module.linear(x, None)
        best = min(best, time.perf_counter() - start)
    return best


# (isa, activations, batch-1 row blocks); None: the default
VARIANTS = {
    "old": ("avx2", "fp32", True),
    "int16": (None, "int16", True),
    "i16rw": (None, "int16", False),
    "int8": (None, "int8", True),
}


def report(label: str, seconds: float, nbytes: int, bandwidth: float) -> None:
    bound = nbytes / bandwidth
    print(
        f"  {label:5s} {seconds * 1e3:8.2f} ms for {nbytes / 1e6:6.1f} MB of weights "
        f"({nbytes / seconds / 1e9:5.1f} GB/s, {bound / seconds:4.0%} of the read bound {bound * 1e3:.2f} ms)"
    )


def bench(models, rows: int, threads: int, args) -> None:
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth()
    print(f"threads {threads}, rows {rows}: read bandwidth (sum over 1 GiB) {bandwidth / 1e9:.1f} GB/s")
    quantized = layer_inputs(models["gguf"], rows)
    best = {name: float("inf") for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (isa, activations, row_blocks) in VARIANTS.items():
            choose_kernel(isa, activations)
            set_single_row_blocks(row_blocks, isa)
            time_step(quantized, 1)  # warm-up (and the first build's load)
            best[name] = min(best[name], time_step(quantized, args.repeats))
    choose_kernel(None, activations_from_env())
    set_single_row_blocks(True)
    for name, seconds in best.items():
        report(name, seconds, weight_bytes(quantized), bandwidth)
    if not args.no_dense:
        dense = layer_inputs(models["none"], rows)
        time_step(dense, 1)
        best["dense"] = time_step(dense, args.repeats)
        report("dense", best["dense"], weight_bytes(dense), bandwidth)
    print(
        f"  old / int16 time: {best['old'] / best['int16']:.2f}x; old / int8: {best['old'] / best['int8']:.2f}x; "
        f"i16rw / int16: {best['i16rw'] / best['int16']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="old/new alternations")
    parser.add_argument("--no-dense", action="store_true", help="skip the dequantized fp32 model")
    args = parser.parse_args()
    config = EngineArgs(device="cpu", dtype="float32").create_engine_config().model
    models = {}
    for quantization in ("gguf", "none"):
        if quantization == "none" and args.no_dense:
            continue
        model = load_model(msgspec.structs.replace(config, quantization=quantization))
        if quantization == "none":
            pack_linear_weights(model, torch.float32, torch.device("cpu"))
        models[quantization] = model
    for threads in args.threads:
        for rows in args.rows:
            bench(models, rows, threads, args)


if __name__ == "__main__":
    main()
