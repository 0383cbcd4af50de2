"""``weft bench profile``: where an engine step's CPU time goes, by kind of op.

Runs the in-process engine (``LLM``) on three fixed shapes, each step timed
plainly first and then under ``torch.profiler``: a decode step of 64
running sequences, a 2,048-token prefill step, and a batch-1 decode step.
With ``--fused both`` an engine with the fused CPU kernels off and one with
them on live side by side, and their timed steps alternate round by round.
Each op's self CPU time is put in a group (linear, attention, the fused CPU
kernels, element-wise ops by kind, the rest), so a change to one kind of
work shows as a shift between groups. On a machine shared with other work
only the ratio of the interleaved timings means something.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from benchmarks.bench import step_shapes
from benchmarks.bench.op_groups import group_of
from benchmarks.bench.step_shapes import is_decode, start_shape


def breakdown(events) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(groups, top ops) from ``prof.key_averages()``: self CPU ms and call counts, largest first."""
    ops = [
        {"op": e.key, "group": group_of(e.key), "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
        for e in events
        if e.self_cpu_time_total > 0
    ]
    groups: dict[str, dict[str, Any]] = {}
    for op in ops:
        g = groups.setdefault(op["group"], {"group": op["group"], "self_ms": 0.0, "calls": 0})
        g["self_ms"] += op["self_ms"]
        g["calls"] += op["calls"]
    total = sum(g["self_ms"] for g in groups.values()) or 1.0
    for g in groups.values():
        g["share"] = g["self_ms"] / total
    by_time = sorted(groups.values(), key=lambda g: -g["self_ms"])
    return by_time, sorted(ops, key=lambda o: -o["self_ms"])


def _timed_steps(engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def time_shape(llms: list, name: str, rounds: int) -> list[float]:
    """Median step ms of each engine, their steps interleaved (A, B, A, B, ...) so that a change
    in the machine's load between rounds touches both alike."""
    _, _, steps = step_shapes.SHAPES[name]
    decode = is_decode(name)
    times: list[list[float]] = [[] for _ in llms]
    live = [start_shape(llm, name, "timed", 1, rounds * steps + 8) for llm in llms] if decode else None
    for r in range(rounds):
        for i, llm in enumerate(llms):
            if not decode:  # a fresh prompt each round: no prefix-cache hits
                ids = start_shape(llm, name, f"timed{r}", 10 + r, 2)
            times[i] += _timed_steps(llm.engine, steps)
            if not decode:
                llm.engine.abort_requests(ids)
    for llm, ids in zip(llms, live or []):
        llm.engine.abort_requests(ids)
    return [statistics.median(t) * 1e3 for t in times]


def profile_shape(llm, name: str) -> dict[str, Any]:
    """The profiled breakdown of ``steps`` steps of one shape."""
    from torch.profiler import ProfilerActivity, profile

    _, _, steps = step_shapes.SHAPES[name]
    ids = start_shape(llm, name, "profiled", 2, steps + 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _timed_steps(llm.engine, steps)
    llm.engine.abort_requests(ids)
    groups, ops = breakdown(prof.key_averages())
    return {"shape": name, "groups": groups, "top_ops": ops[:15], "steps": steps}


def run_profile(shapes: list[str], fused: str, rounds: int = 3, **engine_args: Any) -> dict[str, Any]:
    """One engine per mode, all alive at once (the layers choose the kernels at construction)."""
    from kernels import cpu_fused
    from services import LLM

    modes = {"on": ["1"], "off": ["0"], "both": ["0", "1"]}[fused]
    llms = []
    try:
        for mode in modes:
            os.environ[cpu_fused.ENV_SWITCH] = mode
            cpu_fused.available.cache_clear()
            llms.append(LLM(**engine_args))
        runs = [{"fused": mode == "1", "shapes": []} for mode in modes]
        for name in shapes:
            for run, llm, step_ms in zip(runs, llms, time_shape(llms, name, rounds)):
                run["shapes"].append({**profile_shape(llm, name), "step_ms": step_ms})
    finally:
        for llm in llms:
            llm.shutdown()
        cpu_fused.available.cache_clear()
    return {"engine_args": engine_args, "rounds": rounds, "runs": runs}


def format_profile(report: dict[str, Any]) -> str:
    lines = []
    for run in report["runs"]:
        for shape in run["shapes"]:
            lines.append(
                f"\n{shape['shape']}  fused CPU kernels {'on' if run['fused'] else 'off'}: "
                f"{shape['step_ms']:.1f} ms/step (median, unprofiled, interleaved)"
            )
            lines.append(f"  {'group':<40}{'self ms/step':>13}{'share':>8}{'calls/step':>11}")
            for g in shape["groups"]:
                lines.append(
                    f"  {g['group']:<40}{g['self_ms'] / shape['steps']:>13.2f}{g['share']:>8.1%}"
                    f"{g['calls'] / shape['steps']:>11.0f}"
                )
            lines.append(
                "  top ops: "
                + ", ".join(f"{o['op']} {o['self_ms'] / shape['steps']:.2f}" for o in shape["top_ops"][:6])
            )
    if len(report["runs"]) == 2:
        off, on = (r["shapes"] for r in report["runs"])
        lines.append("\nfused on / off, step time (interleaved in one process):")
        for a, b in zip(off, on):
            lines.append(
                f"  {a['shape']:<14} {a['step_ms']:.1f} -> {b['step_ms']:.1f} ms  "
                f"(x{a['step_ms'] / b['step_ms']:.2f} faster)"
            )
    return "\n".join(lines)


# ---- `weft bench profile` arguments


def add_arguments(parser) -> None:
    from services.config.cli_args import add_engine_args

    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=list(step_shapes.SHAPES),
        default=["decode-64", "prefill-2048", "decode-1"],
        help="Which steps to profile: 64-sequence decode, 2,048-token prefill, batch-1 decode "
        "(default), batch-1 decode of a prompt that repeats itself (for speculation).",
    )
    parser.add_argument(
        "--step-phases",
        action="store_true",
        help="Instead of torch.profiler: the wall time of each phase of the whole engine step "
        "(schedule, input prep, forward, logits, sampler, output processing) and the step/forward ratio.",
    )
    parser.add_argument(
        "--workload",
        default=None,
        help="Instead of the fixed shapes: run this workload (a file, or a name in benchmarks/workloads, "
        "e.g. offline-64) through LLM.generate, its steps split into prefill and decode steps: phase "
        "times, step/forward, and the profiled op groups of each kind.",
    )
    parser.add_argument(
        "--fused",
        choices=["on", "off", "both"],
        default="both",
        help="Fused CPU kernels on, off, or off then on in one process (WEFT_CPU_FUSED).",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="Timed rounds per shape, the modes' steps interleaved round by round.",
    )
    parser.add_argument("--output-json", default=None, help="Also write the results to this JSON file.")
    add_engine_args(parser)


def run(args, parser) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from services.config.cli_args import engine_args_from

    engine_args = dataclasses.asdict(engine_args_from(args))
    if "prefill-2048" in args.shapes:
        if engine_args.get("max_num_batched_tokens") is None:
            engine_args["max_num_batched_tokens"] = 2048  # the default is 1024 on some CPUs
        elif engine_args["max_num_batched_tokens"] < 2048:
            parser.error("the prefill-2048 shape needs --max-num-batched-tokens of at least 2048.")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1.")
    if args.workload is not None:
        from benchmarks.bench import workload_profile
        from benchmarks.bench.workload import load_workload, resolve_dataset

        report = workload_profile.run_workload_profile(
            load_workload(resolve_dataset(args.workload)), **engine_args
        )
        print(workload_profile.format_workload_profile(report))
    elif args.step_phases:
        from benchmarks.bench import step_phases

        report = step_phases.run_step_phases(args.shapes, args.rounds, **engine_args)
        print(step_phases.format_report(report))
    else:
        report = run_profile(args.shapes, args.fused, args.rounds, **engine_args)
        print(format_profile(report))
    if args.output_json is not None:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0
