"""Offline throughput: the whole workload through weft's ``LLM.generate``.

Only ``generate`` is timed: model loading, KV cache profiling and warm-up
are the engine's start-up, not its throughput.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.bench.workload import Workload


@dataclass(frozen=True)
class BenchResult:
    """The figures of one backend's run over one workload."""

    backend: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # counted tokens only (the HF baseline's padding excluded)
    elapsed_s: float
    details: dict[str, Any] = field(default_factory=dict)
    # CPU seconds of this process over the timed run (all its threads). On a
    # shared machine the wall clock moves with other people's load; CPU time
    # per token moves much less, so ratios of it are the steadier figure.
    cpu_s: float | None = None

    def __post_init__(self) -> None:
        assert self.elapsed_s > 0, "a timed run takes some time"

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def output_tokens_per_cpu_s(self) -> float | None:
        return None if not self.cpu_s else self.output_tokens / self.cpu_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "output_tokens_per_cpu_s": self.output_tokens_per_cpu_s,
        }


def summed_runs(runs: list[BenchResult], details: dict[str, Any]) -> BenchResult:
    """Several runs of one workload by one backend as one: requests, tokens and seconds added
    up (CPU seconds only where every run has them), with ``details`` for the whole."""
    cpu = [r.cpu_s for r in runs]
    return BenchResult(
        backend=runs[0].backend,
        num_requests=sum(r.num_requests for r in runs),
        prompt_tokens=sum(r.prompt_tokens for r in runs),
        output_tokens=sum(r.output_tokens for r in runs),
        elapsed_s=sum(r.elapsed_s for r in runs),
        cpu_s=None if None in cpu else sum(c for c in cpu if c is not None),
        details=details,
    )


def run_weft(workload: Workload, use_tqdm: bool = False, **engine_args: Any) -> BenchResult:
    """Run every request of ``workload`` through one ``LLM.generate`` call.

    ``engine_args`` are ``LLM``'s (vLLM's names); the result's details say
    what the engine resolved ``"auto"`` values to.
    """
    # Imported here: it loads torch and the engine, which `weft bench --help`
    # and the workload checks do not need.
    from services import LLM

    llm = LLM(**engine_args)
    outputs, elapsed, cpu = timed_generate(llm, workload, use_tqdm)
    config = llm.config
    return weft_result(
        workload,
        outputs,
        elapsed,
        cpu,
        # As the engine resolved them: the HF baseline runs the same ones.
        {
            "dtype": config.model.dtype,
            "device": config.device.device,
            "torch_threads": config.device.num_threads,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "spec_decode": spec_details(llm),
        },
    )


def timed_generate(
    llm: Any, workload: Workload, use_tqdm: bool, after: Callable[[], Any] | None = None
) -> tuple[list[Any], float, float]:
    """Greedy ``llm.generate`` over every request of ``workload``: its outputs, wall and CPU
    seconds. ``after`` runs once generation is done, before the engine shuts down."""
    from services import SamplingParams

    prompts = [request.prompt_token_ids for request in workload.requests]
    params = [
        SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)
        for request in workload.requests
    ]
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if after is not None:
            after()
    finally:
        llm.shutdown()
    return outputs, elapsed, cpu


def weft_result(
    workload: Workload, outputs: list[Any], elapsed: float, cpu: float, details: dict[str, Any]
) -> BenchResult:
    return BenchResult(
        backend="weft",
        num_requests=len(outputs),
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=sum(len(output.outputs[0].token_ids) for output in outputs),
        elapsed_s=elapsed,
        cpu_s=cpu,
        details=details,
    )


def spec_details(llm: Any) -> dict[str, Any] | None:
    """Acceptance figures of an engine's whole life (None without speculation)."""
    if llm.config.speculative is None:
        return None
    totals = llm.engine.stats_logger.spec_totals
    return {
        "num_speculative_tokens": llm.config.speculative.num_speculative_tokens,
        "num_drafts": totals.num_drafts,
        "num_draft_tokens": totals.num_draft_tokens,
        "num_accepted_tokens": totals.num_accepted_tokens,
        "acceptance_rate": totals.acceptance_rate,
        "mean_accepted_length": totals.mean_accepted_length,
        "per_position_acceptance_rate": totals.per_position_rates(),
    }


def warn_if_short(result: BenchResult, workload: Workload) -> None:
    if result.output_tokens != workload.num_output_tokens:
        print(
            f"warning: {result.backend} produced {result.output_tokens} output tokens, "
            f"the workload asks for {workload.num_output_tokens}; its figures are off.",
            file=sys.stderr,
        )
