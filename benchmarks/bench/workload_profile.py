"""``weft bench profile --workload FILE``: where a real workload's time goes, by kind of step.

The fixed shapes of ``profile.py`` are one kind of step each; a real workload
(offline-64) mixes prefill steps of several prompts with decode steps of many
sequences. This runs the whole workload through ``LLM.generate`` twice in one
engine (the prefix cache reset between, so the second pass computes every
prompt again):

1. unprofiled, with the engine step's phases timed (``step_phases.py``):
   per kind of step, the count, wall time and forward time, and what the
   rest of the step is spent on (schedule, sampler, output processing);
   the time ``generate`` spends outside engine steps (detokenizing) too;
2. under ``torch.profiler``: each op's self CPU time, grouped as
   ``profile.py`` groups them, split by the kind of step it ran in.

A step is a "prefill" step when some request in it has more than one new
token (a prompt or a prompt chunk; without speculation nothing else does),
else a "decode" step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from benchmarks.bench.op_groups import group_of
from benchmarks.bench.step_phases import instrumented
from benchmarks.bench.workload import Workload

KINDS = ("prefill", "decode")
_STEP_EVENT = "weft_bench::engine_step"


def step_kind(scheduler_output) -> str:
    """``prefill`` when some request has more than one new token this step, else ``decode``."""
    counts = scheduler_output.num_scheduled_tokens
    return "prefill" if any(n > 1 for n in counts.values()) else "decode"


class StepLog:
    """Wraps one engine's ``step`` (an instance attribute, removed by ``close``) to note each
    step's kind, token count and wall time; with a phase clock, each step's phase self times."""

    def __init__(self, engine, clock=None) -> None:
        self.engine, self.clock = engine, clock
        self.steps: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        schedule, step = engine.scheduler.schedule, engine.step
        # What ``close`` puts back: an instance attribute set by another wrapper stays.
        self._saved = [
            (o, a, o.__dict__.get(a)) for o, a in ((engine.scheduler, "schedule"), (engine, "step"))
        ]

        def noted_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if out.total_num_scheduled_tokens and self._pending is not None:
                self._pending.update(kind=step_kind(out), tokens=out.total_num_scheduled_tokens)
                self._pending["seqs"] = len(out.num_scheduled_tokens)
            return out

        def logged_step():
            self._pending = {}
            before = dict(clock.self_s) if clock is not None else {}
            start = time.perf_counter()
            out = step()
            wall = time.perf_counter() - start
            if "kind" in self._pending:  # a step that ran a forward
                phases = {k: v - before.get(k, 0.0) for k, v in clock.self_s.items()} if clock else {}
                self.steps.append({**self._pending, "wall_s": wall, "phases_s": phases})
            self._pending = None
            return out

        engine.scheduler.schedule, engine.step = noted_schedule, logged_step

    def close(self) -> None:
        for owner, attr, saved in self._saved:
            if saved is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, saved)


def _params(workload: Workload):
    from services import SamplingParams

    return [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload.requests
    ]


def _generate(llm, workload: Workload) -> float:
    """Seconds of one ``generate`` over the whole workload, from an empty prefix cache."""
    if not llm.engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset: some request still holds blocks.")
    prompts = [r.prompt_token_ids for r in workload.requests]
    start = time.perf_counter()
    llm.generate(prompts, _params(workload), use_tqdm=False)
    return time.perf_counter() - start


def phase_pass(llm, workload: Workload) -> dict[str, Any]:
    """The unprofiled pass: per kind of step, count, tokens, wall and per-phase time."""
    with instrumented(llm.engine) as clock:
        log = StepLog(llm.engine, clock)
        try:
            generate_s = _generate(llm, workload)
        finally:
            log.close()
    kinds = {kind: summarize([s for s in log.steps if s["kind"] == kind]) for kind in KINDS}
    steps_s = sum(s["wall_s"] for s in log.steps)
    return {"generate_s": generate_s, "outside_steps_s": generate_s - steps_s, "kinds": kinds}


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals of one kind of step: count, tokens, wall seconds, forward seconds, phase seconds."""
    phases: dict[str, float] = defaultdict(float)
    for s in steps:
        for name, sec in s["phases_s"].items():
            phases[name] += sec
    wall = sum(s["wall_s"] for s in steps)
    phases["other"] = max(0.0, wall - sum(phases.values()))
    return {
        "steps": len(steps),
        "tokens": sum(s["tokens"] for s in steps),
        "seqs": sum(s["seqs"] for s in steps),
        "wall_s": wall,
        "forward_s": phases.get("forward", 0.0),
        "phases_s": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
    }


def profiled_pass(llm, workload: Workload) -> dict[str, Any]:
    """The profiled pass: each op's self CPU time by group, split by the kind of step it ran in."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    log = StepLog(llm.engine)
    step = llm.engine.step

    def labelled_step():
        with torch.profiler.record_function(_STEP_EVENT):
            return step()

    llm.engine.step = labelled_step
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _generate(llm, workload)
    finally:
        llm.engine.step = step  # the log's own wrapper, which it takes away
        log.close()
    return group_by_step_kind(prof.events(), [s["kind"] for s in log.steps])


def group_by_step_kind(events, kinds: list[str]) -> dict[str, Any]:
    """Self CPU ms and calls per kind of step, by op group (``groups``) and by op (``top_ops``,
    the largest 10), from profiler ``events``: the i-th step event that ran an op is
    ``kinds[i]``; ops outside steps are counted as "idle"."""
    steps = sorted((e for e in events if e.name == _STEP_EVENT), key=lambda e: e.time_range.start)
    # Steps that scheduled nothing ran no op below the step event itself: drop them.
    busy = [e for e in steps if e.cpu_children]
    if len(busy) != len(kinds):
        raise RuntimeError(f"{len(busy)} profiled steps ran ops, but {len(kinds)} steps were logged.")
    kind_of = {id(e): k for e, k in zip(busy, kinds)}
    groups: dict[str, dict[str, list[float]]] = {}
    ops: dict[str, dict[str, list[float]]] = {}
    for e in events:
        if e.name == _STEP_EVENT or e.self_cpu_time_total <= 0:
            continue
        kind = kind_of.get(id(_top_step(e)), "idle")
        for table, key in ((groups, group_of(e.name)), (ops, e.name)):
            cell = table.setdefault(kind, {}).setdefault(key, [0.0, 0])
            cell[0] += e.self_cpu_time_total / 1e3
            cell[1] += 1
    return {
        "groups": {kind: _ranked(g, "group") for kind, g in groups.items()},
        "top_ops": {kind: _ranked(o, "op")[:10] for kind, o in ops.items()},
    }


def _top_step(event):
    while event is not None and event.name != _STEP_EVENT:
        event = event.cpu_parent
    return event


def _ranked(cells: dict[str, list[float]], name: str) -> list[dict[str, Any]]:
    total = sum(ms for ms, _ in cells.values()) or 1.0
    rows = [{name: key, "self_ms": ms, "calls": n, "share": ms / total} for key, (ms, n) in cells.items()]
    return sorted(rows, key=lambda r: -r["self_ms"])


def run_workload_profile(workload: Workload, **engine_args: Any) -> dict[str, Any]:
    from services import LLM

    llm = LLM(**engine_args)
    try:
        _generate(llm, workload.head(min(4, len(workload.requests))))  # warm-up: first-call costs
        phases = phase_pass(llm, workload)
        ops = profiled_pass(llm, workload)
    finally:
        llm.shutdown()
    return {"engine_args": engine_args, "dtype": llm.config.model.dtype, "phases": phases, "ops": ops}


def format_workload_profile(report: dict[str, Any]) -> str:
    p = report["phases"]
    lines = [
        f"dtype {report['dtype']}: generate {p['generate_s']:.2f} s unprofiled, "
        f"{p['outside_steps_s']:.2f} s of it outside engine steps (output processing)",
    ]
    for kind in KINDS:
        k = p["kinds"][kind]
        if not k["steps"]:
            continue
        lines.append(
            f"\n{kind} steps: {k['steps']}, {k['tokens'] / k['steps']:.0f} tokens and "
            f"{k['seqs'] / k['steps']:.1f} sequences per step, {k['wall_s']:.2f} s wall "
            f"({k['wall_s'] / p['generate_s']:.1%} of generate), {k['wall_s'] * 1e3 / k['steps']:.1f} ms/step, "
            f"step/forward {k['wall_s'] / k['forward_s']:.3f}"
        )
        lines.append(
            "  phases (s): " + ", ".join(f"{n} {s:.2f}" for n, s in k["phases_s"].items() if s >= 0.005)
        )
        groups = report["ops"]["groups"].get(kind, [])
        lines.append(f"  {'op group (profiled)':<40}{'self ms/step':>13}{'share':>8}{'calls/step':>11}")
        for g in groups:
            lines.append(
                f"  {g['group']:<40}{g['self_ms'] / k['steps']:>13.2f}{g['share']:>8.1%}"
                f"{g['calls'] / k['steps']:>11.0f}"
            )
        top = report["ops"]["top_ops"].get(kind, [])[:6]
        lines.append(
            "  top ops (ms/step): " + ", ".join(f"{o['op']} {o['self_ms'] / k['steps']:.2f}" for o in top)
        )
    return "\n".join(lines)
