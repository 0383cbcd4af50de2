"""Time every weight matmul of one forward of the default model, kept quantized vs dequantized.

    python scripts/quant_linear_bench.py --rows 1 64 --threads 1

For each row count (1: a batch-1 decode step; 64: a decode step of 64
requests), runs each linear layer and the LM head once on random inputs,
the quantized model through ``QuantizedWeight`` and the dequantized one
through the oneDNN-packed fp32 weights the CPU worker uses, and prints the
best of ``--repeats`` times. Alongside, the bytes of weights each read per
step over that time, and the machine's read bandwidth measured here (a sum
over a buffer much larger than the caches), so the batch-1 figure can be put
as a fraction of the weight-read bound.
"""

from __future__ import annotations

import argparse
import time

import msgspec
import torch

from services.config.engine_args import EngineArgs
from services.worker.layers.linear import LinearBase, pack_linear_weights
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineArgs(device="cpu", dtype="float32").create_engine_config().model
    models = {}
    for quantization in ("gguf", "none"):
        model = load_model(msgspec.structs.replace(config, quantization=quantization))
        if quantization == "none":
            pack_linear_weights(model, torch.float32, torch.device("cpu"))
        models[quantization] = model
    bandwidth = read_bandwidth()
    print(f"read bandwidth (sum over 1 GiB, {args.threads} thread(s)): {bandwidth / 1e9:.1f} GB/s")
    for rows in args.rows:
        times = {}
        for name, model in models.items():
            inputs = layer_inputs(model, rows)
            time_step(inputs, 1)  # warm-up
            times[name] = time_step(inputs, args.repeats)
            nbytes = weight_bytes(inputs)
            print(
                f"rows {rows:4d}  {name:4s}: {times[name] * 1e3:7.2f} ms for {nbytes / 1e6:6.1f} MB of weights "
                f"({nbytes / times[name] / 1e9:5.1f} GB/s; the read bound is {nbytes / bandwidth * 1e3:.2f} ms)"
            )
        print(f"rows {rows:4d}  dequantized / quantized time: {times['none'] / times['gguf']:.2f}x")


if __name__ == "__main__":
    main()
