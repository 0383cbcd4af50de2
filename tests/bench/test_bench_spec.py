"""`weft bench throughput --speculative-config ... --compare-no-spec`: arguments and report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench import cli, spec_decode, throughput
from benchmarks.bench.throughput import BenchResult
from benchmarks.bench.workload import Workload

pytestmark = pytest.mark.slow

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def test_runs_without_then_with_speculation_and_reports_the_speedup(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    workloads_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[Any] = []

    def run_weft(workload: Workload, use_tqdm: bool = False, **engine_args: Any) -> BenchResult:
        spec = engine_args["speculative_config"]
        seen.append((spec, engine_args["max_num_seqs"]))
        stats = {
            "acceptance_rate": 0.5,
            "mean_accepted_length": 3.0,
            "num_accepted_tokens": 6,
            "num_draft_tokens": 12,
            "num_drafts": 3,
            "per_position_acceptance_rate": [1.0, 0.5, 0.5, 0.0],
        }
        return BenchResult(
            backend="weft",
            num_requests=len(workload.requests),
            prompt_tokens=workload.num_prompt_tokens,
            output_tokens=workload.num_output_tokens,
            elapsed_s=1.0 if spec else 2.5,
            cpu_s=2.0 if spec else 4.0,
            details={"max_num_seqs": 1, "spec_decode": stats if spec else None},
        )

    monkeypatch.setattr(throughput, "run_weft", run_weft)
    out = tmp_path / "spec.json"
    argv = [
        "throughput",
        "--dataset",
        str(workloads_dir / "smoke-8.json"),
        "--max-num-seqs",
        "1",
        "--speculative-config",
        SPEC,
        "--compare-no-spec",
        "--output-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    # The same arguments, speculation off first, alternating.
    assert seen == [(None, 1), (SPEC, 1)] * spec_decode.ROUNDS
    report = json.loads(out.read_text())
    assert report["speedup_output_tokens_per_s"] == pytest.approx(2.5)
    assert report["speedup_output_tokens_per_cpu_s"] == pytest.approx(2.0)
    assert report["spec_decode"]["acceptance_rate"] == 0.5
    table = capsys.readouterr().out
    assert "speed-up 2.50x (wall clock; per round 2.50x, 2.50x), 2.00x (CPU time)" in table
    assert "acceptance rate 50.0%, mean accepted length 3.00" in table


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--compare-no-spec"], "--compare-no-spec needs --speculative-config"),
        (["--speculative-config", "{bad"], "speculative_config is not valid JSON"),
        (["--speculative-config", '{"num_speculative_tokens": 0}'], "num_speculative_tokens"),
    ],
)
def test_bad_speculative_arguments_exit_with_a_reason(
    argv: list[str],
    why: str,
    workloads_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["throughput", "--dataset", str(workloads_dir / "smoke-8.json"), *argv])
    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err


def test_alternating_runs_are_summed_and_their_drafts_pooled() -> None:
    """Rates over the summed runs; acceptance from the pooled draft counts, per position weighted by drafts."""

    def result(elapsed: float, stats: dict[str, Any] | None) -> BenchResult:
        return BenchResult(
            "weft", 2, 10, 40, elapsed, {"max_num_seqs": 1, "spec_decode": stats}, cpu_s=elapsed
        )

    first = {"num_speculative_tokens": 2, "num_drafts": 10, "num_draft_tokens": 20, "num_accepted_tokens": 10}
    second = {
        "num_speculative_tokens": 2,
        "num_drafts": 30,
        "num_draft_tokens": 60,
        "num_accepted_tokens": 50,
    }
    first |= {"acceptance_rate": 0.5, "mean_accepted_length": 2.0, "per_position_acceptance_rate": [0.6, 0.4]}
    second |= {
        "acceptance_rate": 50 / 60,
        "mean_accepted_length": 80 / 30,
        "per_position_acceptance_rate": [1.0, 2 / 3],
    }
    summed = spec_decode._summed([result(1.0, first), result(3.0, second)])
    assert (summed.output_tokens, summed.elapsed_s, summed.cpu_s, summed.num_requests) == (80, 4.0, 4.0, 4)
    stats = summed.details["spec_decode"]
    assert (stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]) == (40, 80, 60)
    assert stats["acceptance_rate"] == pytest.approx(0.75)
    assert stats["mean_accepted_length"] == pytest.approx(2.5)
    # Accepted at position 0: 6 + 30 of 40 drafts; at position 1: 4 + 20.
    assert stats["per_position_acceptance_rate"] == pytest.approx([36 / 40, 24 / 40])
    assert spec_decode._summed([result(1.0, None), result(2.0, None)]).details["spec_decode"] is None
