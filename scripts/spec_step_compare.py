"""Batch-1 decode step without and with n-gram speculation, interleaved in one process.

Two engines live side by side (the same weights, one with ``speculative_config``); each round
times 32 steps of the ``repeat-1`` shape (a prompt repeating one 32-token span, so the proposer
finds drafts) on each in turn, by phase (``weft bench profile --step-phases``). A verify step
that costs about one plain step makes speculation pay about its mean accepted length.

    python scripts/spec_step_compare.py --quantization gguf   # weights kept quantized
    python scripts/spec_step_compare.py --quantization none   # dense fp32
"""

from __future__ import annotations

import argparse

from services import LLM
from services.bench import step_phases

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def describe(name: str, result: dict) -> str:
    phases = result["phases_ms"]
    return (
        f"{name:<6} step {result['step_ms_mean']:.1f} ms (forward {phases['forward']:.1f}, logits "
        f"{phases['logits']:.1f}, propose {phases.get('spec: propose', 0.0):.2f}, verify "
        f"{phases.get('spec: verify', 0.0):.2f}); {result['tokens_per_step']:.2f} tokens/step, "
        f"{result['ms_per_token']:.1f} ms/token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", choices=["none", "gguf"], required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    # Two engines at once: a smaller KV cache each.
    engine = dict(
        quantization=args.quantization, dtype="float32", kv_cache_memory=1200 << 20, max_model_len=1024
    )
    llms = {"plain": LLM(**engine), "spec": LLM(speculative_config=SPEC, **engine)}
    try:
        for r in range(args.rounds):
            results = {
                name: step_phases.measure_shapes(llm, ["repeat-1"], 1)[0] for name, llm in llms.items()
            }
            for name, result in results.items():
                print(f"round {r}: {describe(name, result)}", flush=True)
            plain, spec = results["plain"], results["spec"]
            print(
                f"round {r}: verify step / plain step {spec['step_ms_mean'] / plain['step_ms_mean']:.2f}, "
                f"speed-up per token x{plain['ms_per_token'] / spec['ms_per_token']:.2f}",
                flush=True,
            )
    finally:
        for llm in llms.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
