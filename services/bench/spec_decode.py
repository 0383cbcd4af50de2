"""``weft bench throughput --speculative-config ... --compare-no-spec``.

Runs the workload through the offline engine without speculation, then with
the given ``speculative_config`` (every other engine argument the same), in
one process, and reports both rates, the speed-up and the acceptance figures.
With ``--max-num-seqs 1`` the requests run one at a time: single-request
decode speed.
"""

from __future__ import annotations

from typing import Any

from services.bench import throughput
from services.bench.workload import Workload


def run_spec_comparison(workload: Workload, use_tqdm: bool = False, **engine_args: Any) -> dict[str, Any]:
    if not engine_args.get("speculative_config"):
        raise ValueError("--compare-no-spec needs --speculative-config.")
    plain = throughput.run_weft(workload, use_tqdm, **{**engine_args, "speculative_config": None})
    spec = throughput.run_weft(workload, use_tqdm, **engine_args)
    report: dict[str, Any] = {
        "workload": workload.name,
        "speculative_config": engine_args["speculative_config"],
        "no_spec": plain.to_dict(),
        "spec": spec.to_dict(),
        "speedup_output_tokens_per_s": spec.output_tokens_per_s / plain.output_tokens_per_s,
        "spec_decode": spec.details.get("spec_decode"),
    }
    if plain.output_tokens_per_cpu_s and spec.output_tokens_per_cpu_s:
        report["speedup_output_tokens_per_cpu_s"] = (
            spec.output_tokens_per_cpu_s / plain.output_tokens_per_cpu_s
        )
    return report


def spec_table(workload: Workload, report: dict[str, Any]) -> str:
    lines = [
        f"workload {workload.name}: {len(workload.requests)} requests, {workload.num_prompt_tokens} prompt + "
        f"{workload.num_output_tokens} output tokens; max_num_seqs "
        f"{report['spec']['details']['max_num_seqs']}; speculative_config {report['speculative_config']}",
        f"{'run':<12}{'time (s)':>10}{'output tok/s':>15}{'output tok/CPU-s':>18}",
    ]
    for key, label in (("no_spec", "no spec"), ("spec", "spec")):
        r = report[key]
        per_cpu = r.get("output_tokens_per_cpu_s")
        lines.append(
            f"{label:<12}{r['elapsed_s']:>10.2f}{r['output_tokens_per_s']:>15.1f}"
            f"{per_cpu if per_cpu is not None else float('nan'):>18.1f}"
        )
    speedup = f"speed-up {report['speedup_output_tokens_per_s']:.2f}x (wall clock)"
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
