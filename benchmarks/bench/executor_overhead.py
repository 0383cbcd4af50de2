"""``weft bench executor``: what the multi-process executor adds to one engine step.

Times ``execute_model`` round trips with a model-free worker, so only the
executor is measured: for the multi-process executor, the SchedulerOutput
encoded once, published to T worker processes and decoded there, then T
replies back (the driver's carrying the ModelRunnerOutput) and decoded; for
the in-process executor, the same call without any IPC. Each step is a
steady decode step of N running requests (one token each, a new block for
one request in 16), with request ids as long as the API's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from protocol import (
    CachedRequestData,
    EngineConfig,
    ModelConfig,
    ModelRunnerOutput,
    SchedulerOutput,
)
from protocol.codec import Encoder
from protocol.config import DeviceConfig, ParallelConfig
from protocol.executor import ExecuteModel

DUMMY_WORKER = "benchmarks.bench.executor_overhead:DummyWorker"
_PROMPT_LEN = 128


class DummyWorker:
    """A worker without a model: answers each step as the real runner would, at once."""

    def __init__(
        self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        self.config = config

    def init_device(self) -> None: ...

    def determine_num_blocks(self) -> int:
        return 1024

    def initialize_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[[42] for _ in req_ids], logprobs=[[] for _ in req_ids]
        )

    def shutdown(self) -> None: ...


def decode_step(num_requests: int, step: int) -> SchedulerOutput:
    req_ids = [f"cmpl-{i:032x}-0" for i in range(num_requests)]
    computed = _PROMPT_LEN + step
    new_blocks = [[1000 + step + i] if (computed + i) % 16 == 0 else [] for i in range(num_requests)]
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(req_ids, new_blocks, [computed] * num_requests),
        num_scheduled_tokens={r: 1 for r in req_ids},
        total_num_scheduled_tokens=num_requests,
    )


def bench_config(tensor_parallel_size: int) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model="none", tokenizer="none", served_model_name="dummy", dtype="float32", max_model_len=4096
        ),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        device=DeviceConfig(num_threads=1),
    )


def time_steps(executor, num_requests: int, num_steps: int, num_warmup: int) -> list[float]:
    """Seconds per ``execute_model`` call, warm-up excluded."""
    steps = [decode_step(num_requests, i) for i in range(num_warmup + num_steps)]
    times = []
    for i, step in enumerate(steps):
        start = time.perf_counter()
        out = executor.execute_model(step)
        elapsed = time.perf_counter() - start
        assert len(out.req_ids) == num_requests
        if i >= num_warmup:
            times.append(elapsed)
    return times


def run_executor_bench(
    tensor_parallel_size: int, request_counts: list[int], num_steps: int, num_warmup: int = 50
) -> dict[str, Any]:
    from services.worker.executor import UniProcExecutor
    from services.worker.multiproc_executor import MultiprocExecutor

    if tensor_parallel_size < 2:
        raise ValueError(
            f"--tensor-parallel-size must be at least 2 to compare executors, got {tensor_parallel_size}."
        )
    rows = []
    executors = [
        ("uniproc", UniProcExecutor(bench_config(1), worker_class=DUMMY_WORKER)),
        (
            f"multiproc (TP={tensor_parallel_size})",
            MultiprocExecutor(bench_config(tensor_parallel_size), worker_class=DUMMY_WORKER),
        ),
    ]
    try:
        for num_requests in request_counts:
            size = sum(len(f) for f in Encoder().encode(ExecuteModel(decode_step(num_requests, 0))))
            for name, executor in executors:
                times = time_steps(executor, num_requests, num_steps, num_warmup)
                rows.append(
                    {
                        "executor": name,
                        "num_requests": num_requests,
                        "message_bytes": size,
                        **_describe_us(times),
                    }
                )
    finally:
        for _, executor in executors:
            executor.shutdown()
    return {"tensor_parallel_size": tensor_parallel_size, "num_steps": num_steps, "rows": rows}


def _describe_us(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "mean_us": statistics.fmean(times) * 1e6,
        "p50_us": ordered[len(ordered) // 2] * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
    }


def format_executor_bench(report: dict[str, Any]) -> str:
    lines = [
        f"execute_model round trip, model-free worker, {report['num_steps']} decode steps each",
        f"{'executor':<20}{'requests':>9}{'call bytes':>12}{'mean us':>10}{'p50 us':>10}{'p99 us':>10}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['executor']:<20}{row['num_requests']:>9}{row['message_bytes']:>12}"
            f"{row['mean_us']:>10.1f}{row['p50_us']:>10.1f}{row['p99_us']:>10.1f}"
        )
    return "\n".join(lines)


# ---- `weft bench executor` arguments


def add_arguments(parser) -> None:
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=3, help="Worker processes of the multi-process executor."
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        nargs="+",
        default=[1, 64, 256],
        help="Running requests per step (one run each).",
    )
    parser.add_argument("--num-steps", type=int, default=500, help="Timed steps per run.")
    parser.add_argument("--num-warmup", type=int, default=50, help="Untimed steps first.")
    parser.add_argument("--output-json", default=None, help="Also write the results to this JSON file.")


def run(args, parser) -> int:
    import json
    from pathlib import Path

    if min(args.num_requests) < 1 or args.num_steps < 1 or args.num_warmup < 0:
        parser.error("--num-requests and --num-steps must be at least 1, --num-warmup at least 0.")
    try:
        report = run_executor_bench(
            args.tensor_parallel_size, args.num_requests, args.num_steps, args.num_warmup
        )
    except ValueError as e:
        parser.error(str(e))
    print(format_executor_bench(report))
    if args.output_json is not None:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
