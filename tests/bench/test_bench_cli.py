"""`weft bench throughput`: arguments, the report, and the real end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench import cli, throughput
from benchmarks.bench.throughput import BenchResult
from benchmarks.bench.workload import Workload

pytestmark = pytest.mark.slow

FIGURES = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")


@pytest.fixture
def smoke8(workloads_dir: Path) -> str:
    return str(workloads_dir / "smoke-8.json")


def test_end_to_end_throughput_on_smoke8(tmp_path: Path, smoke8: str) -> None:
    out = tmp_path / "result.json"
    argv = [
        "throughput",
        "--dataset",
        smoke8,
        "--num-threads",
        "1",
        "--max-num-batched-tokens",
        "512",
        "--quiet",
        "--output-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    weft = report["weft"]
    assert all(weft[figure] > 0 for figure in FIGURES)
    assert weft["num_requests"] == 8
    assert weft["prompt_tokens"] == 359
    assert weft["output_tokens"] == 63  # the workload's total: ignore_eos held


def _fake_run(backend: str, elapsed_s: float) -> Any:
    def run(workload: Workload, *args: Any, **kwargs: Any) -> BenchResult:
        return BenchResult(
            backend=backend,
            num_requests=len(workload.requests),
            prompt_tokens=workload.num_prompt_tokens,
            output_tokens=workload.num_output_tokens,
            elapsed_s=elapsed_s,
            details={"batch_size": 16, "dtype": "float32", "device": "cpu", "torch_threads": 1},
        )

    return run


def test_compare_hf_reports_both_and_the_ratio(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    workloads_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The two runs are stand-ins: this test is about the arguments and the report.
    monkeypatch.setenv("WEFT_WORKLOADS_DIR", str(workloads_dir))  # "smoke-8" is a bare name
    monkeypatch.setattr(throughput, "run_weft", _fake_run("weft", elapsed_s=1.0))
    monkeypatch.setattr(cli, "_run_hf", _fake_run("hf", elapsed_s=4.0))
    out = tmp_path / "result.json"
    argv = [
        "throughput",
        "--dataset",
        "smoke-8",
        "--num-prompts",
        "2",
        "--dtype",
        "float32",
        "--compare-hf",
        "--output-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "smoke-8" and report["dtype"] == "float32"
    assert report["model"] == "SmolLM2-135M-Instruct"
    assert report["weft"]["output_tokens"] == report["hf"]["output_tokens"] == 18
    assert report["weft"]["output_tokens_per_s"] == 18.0
    assert report["hf"]["output_tokens_per_s"] == 4.5
    assert report["weft_over_hf_output_tokens_per_s"] == 4.0
    table = capsys.readouterr().out
    assert "hf (batch 16)" in table and "weft / hf output tokens/s: 4.00x" in table


def test_engine_args_reach_the_engine(monkeypatch: pytest.MonkeyPatch, smoke8: str) -> None:
    seen: dict[str, Any] = {}

    def run_weft(workload: Workload, **engine_args: Any) -> BenchResult:
        seen.update(engine_args)
        return _fake_run("weft", 1.0)(workload)

    monkeypatch.setattr(throughput, "run_weft", run_weft)
    argv = [
        "throughput",
        "--dataset",
        smoke8,
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "256",
    ]
    assert cli.main(argv) == 0
    assert seen["dtype"] == "bfloat16" and seen["model"] is None
    assert seen["max_num_seqs"] == 4 and seen["max_num_batched_tokens"] == 256


@pytest.mark.parametrize(
    "argv, why",
    [
        (["throughput", "--dataset", "no-such-workload"], "Cannot read workload"),
        (["throughput", "--dataset", "{smoke8}", "--num-prompts", "0"], "--num-prompts must be at least 1"),
        (
            ["throughput", "--dataset", "{smoke8}", "--hf-batch-size", "0"],
            "--hf-batch-size must be at least 1",
        ),
        (["throughput", "--dataset", "{smoke8}", "--max-num-seqs", "0"], "max_num_seqs must be at least 1"),
        (["throughput", "--dataset", "{smoke8}", "--dtype", "int8"], "dtype must be one of"),
        (["throughput", "--dataset", "{smoke8}", "--model", "/no/such.gguf"], "Model not found"),
        (["throughput"], "--dataset"),
        (["latency", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["throughput", "--random-input-len", "4"], "need --random-input-len"),
    ],
)
def test_bad_arguments_exit_with_a_reason(
    argv: list[str], why: str, smoke8: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([arg.format(smoke8=smoke8) for arg in argv])
    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err
