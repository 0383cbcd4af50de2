"""``weft bench throughput --structured json``: what guided decoding costs.

One engine runs the workload unconstrained and with every request
constrained by one JSON schema, twice each. Only the ``generate`` calls are
timed; an untimed warm-up first runs every prompt for a few tokens and
loads the grammar backend and compiles the schema (one-time costs per
engine and schema, not per token).

The schema asks for at least ``_MIN_RECORDS`` records, more text than any
workload request may produce, so a constrained request never reaches the
schema's end before its ``max_tokens`` and both runs produce the same
tokens: their tokens/s compare like for like. Besides the two rates, the
report gives what masking costs per step: the engine's fill, measured
during the runs, and the worker's unpack-and-apply, timed apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from benchmarks.bench.throughput import BenchResult, summed_runs
from benchmarks.bench.workload import Workload

_MIN_RECORDS = 64

BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "records": {
            "type": "array",
            "minItems": _MIN_RECORDS,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 30},
                    "kind": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                    "score": {"type": "number"},
                },
                "required": ["id", "name", "kind", "tags", "score"],
            },
        },
    },
    "required": ["title", "records"],
}


def run_structured(workload: Workload, use_tqdm: bool = False, **engine_args: Any) -> dict[str, Any]:
    """Both kinds of run on one ``LLM``; returns the report ``structured_table`` prints.

    The runs go unconstrained, constrained, constrained, unconstrained, and
    each kind's figures are the sum of its two runs: a machine that speeds
    up or slows down steadily during the benchmark favours neither kind.
    """
    from services import LLM, StructuredOutputsParams

    llm = LLM(**engine_args)
    constraint = StructuredOutputsParams(json=BENCH_SCHEMA)
    runs: dict[str, list[BenchResult]] = {"unconstrained": [], "constrained": []}
    fill = _Fill()
    try:
        _warm_up(llm, workload, constraint)
        totals = llm.engine.scheduler.structured_output_manager.totals
        for kind in ("unconstrained", "constrained", "constrained", "unconstrained"):
            before = _Fill.of(totals)
            runs[kind].append(
                _timed_run(llm, workload, constraint if kind == "constrained" else None, use_tqdm, kind)
            )
            if kind == "constrained":
                fill = fill + (_Fill.of(totals) - before)
        apply_ms = _apply_ms_per_step(fill, llm.config.model.vocab_size, llm.config.device.device)
    finally:
        llm.shutdown()
    return _report(
        workload,
        llm.config.model.served_model_name,
        _merged(runs["unconstrained"]),
        _merged(runs["constrained"]),
        fill,
        apply_ms,
    )


@dataclass(frozen=True)
class _Fill:
    """The manager's mask filling: seconds, steps and rows."""

    seconds: float = 0.0
    steps: int = 0
    rows: int = 0

    @classmethod
    def of(cls, totals) -> _Fill:
        return cls(totals.fill_seconds, totals.num_fill_steps, totals.num_fill_rows)

    def __add__(self, other: _Fill) -> _Fill:
        return _Fill(self.seconds + other.seconds, self.steps + other.steps, self.rows + other.rows)

    def __sub__(self, other: _Fill) -> _Fill:
        return _Fill(self.seconds - other.seconds, self.steps - other.steps, self.rows - other.rows)


def _warm_up(llm, workload: Workload, constraint) -> None:
    """Every prompt for a few tokens (the first pass over new batch shapes
    compiles GPU kernels: measured 4x slower on an H200), and one
    constrained request (loads the grammar backend, compiles the schema)."""
    from services import SamplingParams

    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(temperature=0, max_tokens=min(8, r.max_tokens), ignore_eos=True)
        for r in workload.requests
    ]
    constrained = SamplingParams(temperature=0, max_tokens=4, structured_outputs=constraint)
    llm.generate([*prompts, prompts[0]], [*params, constrained], use_tqdm=False)


def _timed_run(llm, workload: Workload, constraint, use_tqdm: bool, backend: str) -> BenchResult:
    from services import SamplingParams

    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True, structured_outputs=constraint)
        for r in workload.requests
    ]
    prompts = [r.prompt_token_ids for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    finished = [o.outputs[0].finish_reason for o in outputs]
    return BenchResult(
        backend=backend,
        num_requests=len(outputs),
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed_s=elapsed,
        details={"finish_reasons": {r: finished.count(r) for r in set(finished)}},
    )


def _merged(runs: list[BenchResult]) -> BenchResult:
    reasons: dict[str, int] = {}
    for run in runs:
        for reason, count in run.details["finish_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    details = {"runs": len(runs), "elapsed_s": [r.elapsed_s for r in runs], "finish_reasons": reasons}
    return summed_runs(runs, details)


def _apply_ms_per_step(fill: _Fill, vocab_size: int, device: str, repeats: int = 20) -> float:
    """The worker's masking of one step's logits (as many rows as the runs
    averaged), timed apart: inside the engine it hides among the sampler's work."""
    import numpy as np
    import torch

    from protocol import CachedRequestData, SchedulerOutput
    from services.engine_core.structured_output.backend import bitmask_words
    from services.worker.structured_output import apply_grammar_bitmask

    rows = max(1, round(fill.rows / max(fill.steps, 1)))
    ids = [str(i) for i in range(rows)]
    bitmask = (
        np.random.default_rng(0).integers(-(2**31), 2**31, (rows, bitmask_words(vocab_size))).astype(np.int32)
    )
    output = SchedulerOutput(
        [], CachedRequestData(), {}, 0, structured_output_request_ids=ids, grammar_bitmask=bitmask
    )
    logits = torch.zeros(rows, vocab_size, device=device)
    first_row = {req_id: i for i, req_id in enumerate(ids)}
    apply_grammar_bitmask(logits, output, first_row)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        apply_grammar_bitmask(logits, output, first_row)
    if device == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / repeats


def _report(
    workload: Workload,
    model: str,
    unconstrained: BenchResult,
    constrained: BenchResult,
    fill: _Fill,
    apply_ms: float,
) -> dict[str, Any]:
    steps = max(fill.steps, 1)
    return {
        "workload": workload.name,
        "model": model,
        "structured": "json",
        "unconstrained": unconstrained.to_dict(),
        "constrained": constrained.to_dict(),
        "constrained_over_unconstrained_output_tokens_per_s": constrained.output_tokens_per_s
        / unconstrained.output_tokens_per_s,
        "mask_steps": fill.steps,
        "mask_rows_per_step": fill.rows / steps,
        # Engine side: filling one step's masks (xgrammar, on the scheduler's thread).
        "mask_fill_ms_per_step": 1000 * fill.seconds / steps,
        # Worker side: unpacking the masks and applying them to one step's logits.
        "mask_apply_ms_per_step": apply_ms,
        # Everything guided decoding added, per masked step: the two kinds' time difference.
        "overhead_ms_per_step": 1000 * (constrained.elapsed_s - unconstrained.elapsed_s) / steps,
    }


def structured_table(workload: Workload, report: dict[str, Any]) -> str:
    lines = [
        f"{workload.summary}; model {report['model']}; constrained run: one JSON schema on every request",
        f"{'run':<16}{'time (s)':>10}{'output tokens':>15}{'output tok/s':>15}",
    ]
    for key in ("unconstrained", "constrained"):
        r = report[key]
        lines.append(
            f"{key:<16}{r['elapsed_s']:>10.2f}{r['output_tokens']:>15}{r['output_tokens_per_s']:>15.1f}"
        )
    lines.append(
        f"constrained / unconstrained output tok/s: "
        f"{report['constrained_over_unconstrained_output_tokens_per_s']:.3f}"
    )
    lines.append(
        f"mask per step ({report['mask_rows_per_step']:.1f} rows, {report['mask_steps']} steps): "
        f"fill {report['mask_fill_ms_per_step']:.3f} ms (engine) + apply "
        f"{report['mask_apply_ms_per_step']:.3f} ms (worker); "
        f"measured overhead {report['overhead_ms_per_step']:.3f} ms/step"
    )
    return "\n".join(lines)
