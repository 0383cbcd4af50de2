"""Async scheduling on and off, side by side in one process, interleaved.

``python -m benchmarks.bench.async_scheduling --batch-sizes 1 64 [engine args]``

Two offline engines with the same arguments, one with ``async_scheduling``,
take turns (A, B then B, A each round) on the same fixed-shape batch of
random prompts (``ignore_eos``). Per batch: the decode wall time per step
(after every request has its first token) and the time the executor's
``execute_model`` took per step over the same steps, so the step/forward
ratio says how much of a step is spent off the forward. With async
scheduling ``execute_model`` runs on its own thread; a ratio near 1 means
only the forward is left on the critical path. On a machine with few cores
the engine's thread competes with the forward's threads: both show here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from benchmarks.bench.datasets import random_workload
from benchmarks.bench.latency import add_greedy_batch


class ExecuteClock:
    """Wall time spent in ``execute_model`` (whatever thread calls it)."""

    def __init__(self, executor) -> None:
        self.total_s = 0.0
        self.calls = 0
        original = executor.execute_model

        def timed(scheduler_output):
            start = time.perf_counter()
            try:
                return original(scheduler_output)
            finally:
                self.total_s += time.perf_counter() - start
                self.calls += 1

        executor.execute_model = timed


def one_batch(llm: Any, clock: ExecuteClock, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Decode ms per step and execute_model ms per step, both after the batch's last first token."""
    counts = add_greedy_batch(llm, prompts, output_len, "async-bench")
    decode_start = None
    executed_at_start = 0.0
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step().outputs:
            counts[output.request_id] += len(output.new_token_ids)
        if decode_start is None and all(counts.values()):
            decode_start, executed_at_start = time.perf_counter(), clock.total_s
    end = time.perf_counter()
    if decode_start is None or any(n != output_len for n in counts.values()):
        raise RuntimeError("a request did not produce its output_len tokens")
    steps = output_len - 1
    return {
        "step_ms": (end - decode_start) / steps * 1000,
        "execute_ms": (clock.total_s - executed_at_start) / steps * 1000,
    }


def run(batch_sizes: list[int], input_len: int, output_len: int, rounds: int, **engine_args) -> dict:
    from services import LLM

    if output_len < 2 or rounds < 1:
        raise ValueError("--output-len must be at least 2 and --rounds at least 1.")
    engines = {mode: LLM(async_scheduling=mode == "async", **engine_args) for mode in ("sync", "async")}
    clocks = {mode: ExecuteClock(llm.engine.executor) for mode, llm in engines.items()}
    results: dict[int, dict[str, list[dict]]] = {b: {"sync": [], "async": []} for b in batch_sizes}
    try:
        vocab = engines["sync"].config.model.vocab_size
        workloads = {
            b: [r.prompt_token_ids for r in random_workload(input_len, output_len, b, vocab, seed=0).requests]
            for b in batch_sizes
        }
        for mode, llm in engines.items():  # warm-up: kernels, allocator, first-touch of the KV cache
            for b in batch_sizes:
                one_batch(llm, clocks[mode], workloads[b], min(output_len, 4))
        for index in range(rounds):
            order = ("sync", "async") if index % 2 == 0 else ("async", "sync")
            for b in batch_sizes:
                for mode in order:
                    results[b][mode].append(one_batch(engines[mode], clocks[mode], workloads[b], output_len))
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {
        "input_len": input_len,
        "output_len": output_len,
        "rounds": rounds,
        "dtype": engines["sync"].config.model.dtype,
        "batches": {str(b): summarize(results[b]) for b in batch_sizes},
    }


def summarize(per_mode: dict[str, list[dict]]) -> dict:
    summary = {}
    for mode, runs in per_mode.items():
        step = statistics.median(r["step_ms"] for r in runs)
        execute = statistics.median(r["execute_ms"] for r in runs)
        summary[mode] = {"step_ms": step, "execute_ms": execute, "step_over_forward": step / execute}
    # Ratio per round (the two ran back to back), then the median: less exposed to a load change.
    speedups = [s["step_ms"] / a["step_ms"] for s, a in zip(per_mode["sync"], per_mode["async"])]
    summary["async_speedup"] = statistics.median(speedups)
    summary["async_speedup_per_round"] = speedups
    return summary


def print_table(result: dict) -> None:
    print(
        f"{result['input_len']} in, {result['output_len']} out, {result['rounds']} rounds, {result['dtype']}"
    )
    print(
        f"{'batch':>5} {'mode':>6} {'step ms':>9} {'execute ms':>11} {'step/fwd':>9} {'async speed-up':>15}"
    )
    for batch, summary in result["batches"].items():
        for mode in ("sync", "async"):
            row = summary[mode]
            speedup = f"{summary['async_speedup']:.2f}x" if mode == "async" else ""
            print(
                f"{batch:>5} {mode:>6} {row['step_ms']:>9.1f} {row['execute_ms']:>11.1f} "
                f"{row['step_over_forward']:>9.2f} {speedup:>15}"
            )


def main(argv: list[str] | None = None) -> int:
    from services.config.cli_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-json", default=None)
    add_engine_args(parser, skip=("async_scheduling",))
    args = parser.parse_args(argv)
    engine_args = {
        k: v
        for k, v in vars(engine_args_from(args, skip=("async_scheduling",))).items()
        if k != "async_scheduling"
    }
    result = run(args.batch_sizes, args.input_len, args.output_len, args.rounds, **engine_args)
    print_table(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
