"""``weft bench profile --step-phases``: where one whole engine step's wall time goes.

``torch.profiler`` shows the forward's ops but not the Python around them.
This times the phases of ``EngineCore.step`` with ``time.perf_counter`` by
wrapping the bound methods of one in-process engine (the code under test is
not changed): schedule, the worker's input-batch update and step inputs, the
forward, the logits, sampling metadata, the sampler, the speculative
proposer and verifier, and the scheduler's output processing. Whatever the
named phases do not cover is "other" (stats, KV events, the calls between).
The step/forward ratio is the figure to watch at batch 1: with a fast
matmul, everything but the forward is per-step overhead.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.bench import step_shapes
from benchmarks.bench.step_shapes import is_decode, start_shape

# (phase, the owner's path from the engine, attribute, kind): a "method" is replaced on its
# instance; a "callable" attribute (an object called for its ``__call__``) by a timed proxy.
# Nested phases are subtracted from the phase that calls them, so each reports its own time.
_PHASES = (
    ("schedule", "scheduler", "schedule", "method"),
    ("update_from_output", "scheduler", "update_from_output", "method"),
    ("execute_model", "runner", "execute_model", "method"),
    ("input_batch.update", "runner.input_batch", "update", "method"),
    ("forward", "runner", "_forward", "method"),
    ("logits", "runner.model", "compute_logits", "method"),
    ("sampler", "runner", "sampler", "callable"),
    ("spec: propose", "runner.spec_decoder", "propose", "method"),
    ("spec: verify", "runner.spec_decoder", "rejection_sampler", "callable"),
)
# Module-level functions the runner calls by name: (phase, module, function).
_FUNCTIONS = (
    ("step inputs", "services.worker.model_runner", "prepare_step"),
    ("sampling metadata", "services.worker.model_runner", "build_sampling_metadata"),
    ("sampling metadata", "services.worker.spec_decode.spec_decoder", "build_sampling_metadata"),
)


_MAX_TOKENS_PER_STEP = 4  # headroom for speculation's emitted drafts


class PhaseClock:
    """Self time per phase: a phase's time less the time of the phases it called."""

    def __init__(self) -> None:
        self.self_s: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open phase: [start, time of its children]

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, children = self._stack.pop()
                elapsed = time.perf_counter() - start
                self.self_s[name] += elapsed - children
                if self._stack:
                    self._stack[-1][1] += elapsed

        return timed


def _resolve(engine, path: str):
    worker = getattr(engine.executor, "worker", None)
    if worker is None:
        raise ValueError("--step-phases times an in-process worker: it needs tensor_parallel_size 1.")
    obj = {"scheduler": engine.scheduler, "runner": worker.model_runner}[path.split(".")[0]]
    for part in path.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class _CallProxy:
    """Stands in for a callable object whose ``__call__`` is timed (a bound
    ``__call__`` cannot be replaced on the instance)."""

    def __init__(self, target, timed_call: Callable) -> None:
        self._target, self._timed_call = target, timed_call

    def __call__(self, *args, **kwargs):
        return self._timed_call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


@contextlib.contextmanager
def instrumented(engine) -> Iterator[PhaseClock]:
    """Time ``engine``'s step phases while the block runs; everything is put back after."""
    import importlib

    clock = PhaseClock()
    undo: list[Callable[[], None]] = []
    try:
        for name, path, attr, kind in _PHASES:
            owner = _resolve(engine, path)
            if owner is None:
                continue
            original = getattr(owner, attr)
            if kind == "callable":
                setattr(owner, attr, _CallProxy(original, clock.wrap(name, original.__call__)))
                undo.append(lambda o=owner, a=attr, v=original: setattr(o, a, v))
            else:
                setattr(owner, attr, clock.wrap(name, original))
                undo.append(lambda o=owner, a=attr: delattr(o, a))
        for name, module_name, function in _FUNCTIONS:
            module = importlib.import_module(module_name)
            original = getattr(module, function)
            setattr(module, function, clock.wrap(name, original))
            undo.append(lambda m=module, f=function, o=original: setattr(m, f, o))
        yield clock
    finally:
        for fn in reversed(undo):
            fn()


def measure_steps(engine, num_steps: int) -> dict[str, Any]:
    """Run ``num_steps`` engine steps, timed whole and by phase: per-step mean ms of each phase,
    the median whole step, and the step/forward ratio."""
    totals = []
    tokens = 0
    spec = engine.stats_logger.spec_totals
    drafts_before, accepted_before = spec.num_drafts, spec.num_accepted_tokens
    with instrumented(engine) as clock:
        for _ in range(num_steps):
            start = time.perf_counter()
            out = engine.step()
            totals.append(time.perf_counter() - start)
            tokens += sum(len(o.new_token_ids) for o in out.outputs)
    step_s = sum(totals)
    phases = {name: s * 1e3 / num_steps for name, s in sorted(clock.self_s.items(), key=lambda kv: -kv[1])}
    phases["other"] = max(0.0, (step_s - sum(clock.self_s.values())) * 1e3 / num_steps)
    forward_ms = phases.get("forward", 0.0)
    mean_ms = step_s * 1e3 / num_steps
    return {
        "steps": num_steps,
        "tokens": tokens,
        "step_ms_mean": mean_ms,
        "step_ms_median": statistics.median(totals) * 1e3,
        "ms_per_token": step_s * 1e3 / max(tokens, 1),
        "tokens_per_step": tokens / num_steps,
        # Speculation: request-steps that verified drafts, and the drafts accepted in them.
        "spec_drafts": spec.num_drafts - drafts_before,
        "spec_accepted": spec.num_accepted_tokens - accepted_before,
        "phases_ms": phases,
        "step_over_forward": mean_ms / forward_ms if forward_ms else None,
    }


def format_phases(label: str, result: dict[str, Any]) -> str:
    lines = [
        f"\n{label}: {result['step_ms_mean']:.2f} ms/step mean ({result['step_ms_median']:.2f} median), "
        f"{result['ms_per_token']:.2f} ms/token, step/forward "
        + (f"{result['step_over_forward']:.2f}" if result["step_over_forward"] else "n/a"),
        f"  {'phase':<22}{'ms/step':>9}{'share':>8}",
    ]
    if result["spec_drafts"]:
        lines.insert(
            1,
            f"  {result['tokens_per_step']:.2f} tokens/step; {result['spec_drafts']} draft verifications, "
            f"{result['spec_accepted']} drafts accepted",
        )
    for name, ms in result["phases_ms"].items():
        lines.append(f"  {name:<22}{ms:>9.3f}{ms / result['step_ms_mean']:>8.1%}")
    return "\n".join(lines)


def run_step_phases(shapes: list[str], rounds: int = 3, **engine_args: Any) -> dict[str, Any]:
    """The phase breakdown of each shape (``step_shapes.SHAPES``) in one fresh engine."""
    from services import LLM

    llm = LLM(**engine_args)
    try:
        results = measure_shapes(llm, shapes, rounds)
    finally:
        llm.shutdown()
    return {"engine_args": engine_args, "rounds": rounds, "dtype": llm.config.model.dtype, "shapes": results}


def measure_shapes(llm, shapes: list[str], rounds: int) -> list[dict[str, Any]]:
    """Decode shapes time ``rounds`` x their step count on the same running requests,
    after a short warm-up; a prefill shape times one step per round, on fresh prompts."""
    results = []
    for name in shapes:
        steps = step_shapes.SHAPES[name][2]
        if is_decode(name):
            # Room for every step to emit its drafts too: no request finishes while timed.
            max_tokens = _MAX_TOKENS_PER_STEP * (rounds + 1) * steps + 64
            ids = start_shape(llm, name, "phases", 4, max_tokens)
            measure_steps(llm.engine, min(steps, 4))  # warm-up
            result = measure_steps(llm.engine, rounds * steps)
            llm.engine.abort_requests(ids)
        else:
            result = _prefill_phases(llm, name, rounds)
        results.append({"shape": name, **result})
    return results


def _prefill_phases(llm, name: str, rounds: int) -> dict[str, Any]:
    runs = []
    for r in range(rounds + 1):  # the first is a warm-up
        ids = start_shape(llm, name, f"phases{r}", 20 + r, 2)
        runs.append(measure_steps(llm.engine, 1))
        llm.engine.abort_requests(ids)
    runs = runs[1:]
    phases = {k: statistics.fmean(run["phases_ms"].get(k, 0.0) for run in runs) for k in runs[0]["phases_ms"]}
    step_ms = statistics.fmean(run["step_ms_mean"] for run in runs)
    forward = phases.get("forward", 0.0)
    return {
        "steps": len(runs),
        "tokens": sum(run["tokens"] for run in runs),
        "step_ms_mean": step_ms,
        "step_ms_median": statistics.median(run["step_ms_mean"] for run in runs),
        "ms_per_token": float("nan"),
        "tokens_per_step": float("nan"),
        "spec_drafts": 0,
        "spec_accepted": 0,
        "phases_ms": phases,
        "step_over_forward": step_ms / forward if forward else None,
    }


def format_report(report: dict[str, Any]) -> str:
    args = {k: v for k, v in report["engine_args"].items() if v is not None}
    lines = [f"step phases, dtype {report['dtype']}, engine args {args}"]
    lines += [format_phases(shape["shape"], shape) for shape in report["shapes"]]
    return "\n".join(lines)
