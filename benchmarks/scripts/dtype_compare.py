"""fp32 vs bf16 for one weight format, interleaved in one process (the figures behind dtype="auto").

Two engines live side by side; each round runs, on each engine in turn, 16 requests of
offline-64 through ``LLM.generate`` and 32 batch-1 decode steps (``--step-phases``' decode-1
shape). On a shared machine only the ratios within a round mean anything.

    python benchmarks/scripts/dtype_compare.py --quantization none   # dense weights
    python benchmarks/scripts/dtype_compare.py --quantization gguf   # weights kept quantized
"""

from __future__ import annotations

import argparse
import time

from benchmarks.bench import step_phases
from benchmarks.bench.step_shapes import start_shape
from benchmarks.bench.workload import load_workload, resolve_dataset
from services import LLM, SamplingParams

DTYPES = ("float32", "bfloat16")


def offline_rate(llm, prompts, params) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def batch1_ms_per_token(llm, round_index: int) -> float:
    ids = start_shape(llm, "decode-1", f"dtype{round_index}", 3 + round_index, 48)
    result = step_phases.measure_steps(llm.engine, 32)
    llm.engine.abort_requests(ids)
    return result["ms_per_token"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", choices=["none", "gguf"], required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    workload = load_workload(resolve_dataset("offline-64")).head(16)
    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload.requests
    ]
    # Two engines at once: a smaller KV cache each (max_model_len 1024 still fits the workload).
    engine = dict(quantization=args.quantization, kv_cache_memory=1200 << 20, max_model_len=1024)
    llms = {dtype: LLM(dtype=dtype, **engine) for dtype in DTYPES}
    try:
        for llm in llms.values():  # warm-up
            llm.generate(prompts[:2], params[:2], use_tqdm=False)
        for r in range(args.rounds):
            rates = {dtype: offline_rate(llm, prompts, params) for dtype, llm in llms.items()}
            ms = {dtype: batch1_ms_per_token(llm, r) for dtype, llm in llms.items()}
            print(
                f"round {r}: offline tok/s fp32 {rates['float32']:.1f}, bf16 {rates['bfloat16']:.1f} "
                f"(x{rates['bfloat16'] / rates['float32']:.2f}); batch-1 ms/token fp32 {ms['float32']:.1f}, "
                f"bf16 {ms['bfloat16']:.1f} (x{ms['float32'] / ms['bfloat16']:.2f} faster)",
                flush=True,
            )
    finally:
        for llm in llms.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
