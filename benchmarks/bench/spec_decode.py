"""``weft bench throughput --speculative-config ... --compare-no-spec``.

Runs the workload through the offline engine without speculation and with
the given ``speculative_config`` (every other engine argument the same), in
one process, alternating (plain, spec, plain, spec: ``ROUNDS`` of each), and
reports the summed rates, the speed-up and the acceptance figures. On a shared
machine the load moves between runs; alternating spreads that over both.
With ``--max-num-seqs 1`` the requests run one at a time: single-request
decode speed.
"""

from __future__ import annotations

from typing import Any

from benchmarks.bench import throughput
from benchmarks.bench.throughput import BenchResult
from benchmarks.bench.workload import Workload

ROUNDS = 2


def run_spec_comparison(
    workload: Workload, use_tqdm: bool = False, rounds: int = ROUNDS, **engine_args: Any
) -> dict[str, Any]:
    if not engine_args.get("speculative_config"):
        raise ValueError("--compare-no-spec needs --speculative-config.")
    plain_runs, spec_runs = [], []
    for _ in range(rounds):
        plain_runs.append(
            throughput.run_weft(workload, use_tqdm, **{**engine_args, "speculative_config": None})
        )
        spec_runs.append(throughput.run_weft(workload, use_tqdm, **engine_args))
    plain, spec = _summed(plain_runs), _summed(spec_runs)
    report: dict[str, Any] = {
        "workload": workload.name,
        "speculative_config": engine_args["speculative_config"],
        "rounds": rounds,
        "no_spec": plain.to_dict(),
        "spec": spec.to_dict(),
        "speedup_output_tokens_per_s": spec.output_tokens_per_s / plain.output_tokens_per_s,
        "speedup_per_round": [
            s.output_tokens_per_s / p.output_tokens_per_s for p, s in zip(plain_runs, spec_runs)
        ],
        "spec_decode": spec.details.get("spec_decode"),
    }
    if plain.output_tokens_per_cpu_s and spec.output_tokens_per_cpu_s:
        report["speedup_output_tokens_per_cpu_s"] = (
            spec.output_tokens_per_cpu_s / plain.output_tokens_per_cpu_s
        )
    return report


def _summed(runs: list[BenchResult]) -> BenchResult:
    """Several runs of one workload as one: tokens, seconds and draft counts added up."""
    details = {
        **runs[0].details,
        "spec_decode": _summed_spec([r.details.get("spec_decode") for r in runs]),
    }
    return throughput.summed_runs(runs, details)


def _summed_spec(stats: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    if any(s is None for s in stats):
        return None
    drafts = sum(s["num_drafts"] for s in stats)
    draft_tokens = sum(s["num_draft_tokens"] for s in stats)
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    # Per-position rates are accepted counts over drafts: weight each run's by its drafts.
    positions = max(len(s["per_position_acceptance_rate"]) for s in stats)
    per_position = [
        sum(s["num_drafts"] * (s["per_position_acceptance_rate"] + [0.0] * positions)[i] for s in stats)
        / max(drafts, 1)
        for i in range(positions)
    ]
    return {
        **stats[0],
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
        "per_position_acceptance_rate": per_position,
    }


def spec_table(workload: Workload, report: dict[str, Any]) -> str:
    lines = [
        f"{workload.summary}; max_num_seqs "
        f"{report['spec']['details']['max_num_seqs']}; speculative_config {report['speculative_config']}; "
        f"{report['rounds']} runs of each, alternating (times and tokens summed)",
        f"{'run':<12}{'time (s)':>10}{'output tok/s':>15}{'output tok/CPU-s':>18}",
    ]
    for key, label in (("no_spec", "no spec"), ("spec", "spec")):
        r = report[key]
        per_cpu = r.get("output_tokens_per_cpu_s")
        lines.append(
            f"{label:<12}{r['elapsed_s']:>10.2f}{r['output_tokens_per_s']:>15.1f}"
            f"{per_cpu if per_cpu is not None else float('nan'):>18.1f}"
        )
    speedup = f"speed-up {report['speedup_output_tokens_per_s']:.2f}x (wall clock"
    if len(report["speedup_per_round"]) > 1:
        speedup += "; per round " + ", ".join(f"{x:.2f}x" for x in report["speedup_per_round"])
    speedup += ")"
    if "speedup_output_tokens_per_cpu_s" in report:
        speedup += f", {report['speedup_output_tokens_per_cpu_s']:.2f}x (CPU time)"
    lines.append(speedup)
    stats = report["spec_decode"]
    if stats:
        rates = ", ".join(f"{rate:.2f}" for rate in stats["per_position_acceptance_rate"])
        lines.append(
            f"acceptance rate {stats['acceptance_rate']:.1%}, mean accepted length "
            f"{stats['mean_accepted_length']:.2f} ({stats['num_accepted_tokens']} of "
            f"{stats['num_draft_tokens']} draft tokens, {stats['num_drafts']} drafts); "
            f"per position [{rates}]"
        )
    return "\n".join(lines)
