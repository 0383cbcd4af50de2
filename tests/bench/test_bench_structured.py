"""`weft bench throughput --structured json`: both runs on one engine, same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from benchmarks.bench import cli
from benchmarks.bench.structured import BENCH_SCHEMA

pytestmark = pytest.mark.slow


def test_structured_bench_on_smoke8(tmp_path: Path, workloads_dir: Path, capsys) -> None:
    out = tmp_path / "structured.json"
    argv = [
        "throughput",
        "--dataset",
        str(workloads_dir / "smoke-8.json"),
        "--num-prompts",
        "2",
        "--structured",
        "json",
        "--dtype",
        "float32",
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
    plain, constrained = report["unconstrained"], report["constrained"]
    # The schema outlasts every request: both runs make exactly the workload's tokens.
    assert plain["output_tokens"] == constrained["output_tokens"] > 0
    assert constrained["details"]["finish_reasons"] == {"length": 4}  # 2 requests, 2 runs
    assert report["constrained_over_unconstrained_output_tokens_per_s"] > 0
    assert (
        report["mask_steps"] > 0
        and report["mask_fill_ms_per_step"] > 0
        and report["mask_apply_ms_per_step"] > 0
    )
    assert "constrained / unconstrained output tok/s" in capsys.readouterr().out


def test_the_bench_schema_is_a_valid_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(BENCH_SCHEMA)
    assert BENCH_SCHEMA["properties"]["records"]["minItems"] >= 64
