"""`weft bench compare` end to end on two requests: weft vs HF static batching, and
the engine's step time against the replayed pure forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench import cli, hf_baseline
from benchmarks.bench.compare import run_hf_continuous, spread_subset
from benchmarks.bench.workload import load_workload

pytestmark = pytest.mark.slow


def test_end_to_end_compare(
    tmp_path: Path,
    workloads_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    hf_default_model,
) -> None:
    loaded = []

    def load_hf_model(model, dtype, device="cpu"):
        # The session's copy of what load_hf_model(None, "float32") returns: one load per session.
        loaded.append((model, dtype, device))
        return hf_default_model

    monkeypatch.setattr(hf_baseline, "load_hf_model", load_hf_model)
    out = tmp_path / "compare.json"
    argv = [
        "compare",
        "--dataset",
        str(workloads_dir / "smoke-8.json"),
        "--num-prompts",
        "2",
        "--hf-batch-sizes",
        "1",
        "2",
        "--hf-bs1-requests",
        "1",
        "--no-hf-continuous",
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        "--max-num-batched-tokens",
        "64",
        "--quiet",
        "--output-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    weft, (hf1, hf) = report["weft"], report["peers"]
    assert weft["output_tokens"] == hf["output_tokens"] == 18  # exactly the requested tokens
    assert hf["label"] == "hf static (batch 2, 2 req)" and hf["details"]["dtype"] == "float32"
    assert hf["weft_over_peer"] == pytest.approx(weft["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert hf["weft_over_peer_cpu"] == pytest.approx(
        weft["output_tokens_per_cpu_s"] / hf["output_tokens_per_cpu_s"]
    )
    assert 0 < weft["cpu_s"] and 0 < hf["cpu_s"]
    assert hf1["label"] == "hf static (batch 1, 1 req)" and hf1["num_requests"] == 1
    e = report["efficiency"]
    assert e["forward_steps"] >= 9  # at least one step per token of the longest request
    assert e["step_s"] >= e["execute_model_s"] > 0 and e["forward_s"] > 0
    assert e["step_over_forward"] == pytest.approx(e["step_s"] / e["forward_s"])
    assert e["step_cpu_s"] > 0 and e["forward_cpu_s"] > 0
    assert e["step_over_forward_cpu"] == pytest.approx(e["step_cpu_s"] / e["forward_cpu_s"])
    assert "step/forward" in capsys.readouterr().out
    assert loaded == [(None, "float32", "cpu")]  # the HF side ran the default model in fp32


def test_batch_one_subset_is_spread_over_the_workload(workloads_dir: Path) -> None:
    workload = load_workload(workloads_dir / "smoke-8.json")
    picked = spread_subset(workload, 4)
    assert picked.requests == workload.requests[::2]
    assert picked.num_prompt_tokens == sum(len(r.prompt_token_ids) for r in workload.requests[::2])
    assert spread_subset(workload, None) is workload and spread_subset(workload, 99) is workload
    with pytest.raises(ValueError, match="at least one request"):
        spread_subset(workload, 0)


def test_continuous_batching_absent_is_a_note(workloads_dir: Path) -> None:
    workload = load_workload(workloads_dir / "smoke-8.json").head(1)
    note = run_hf_continuous(workload, hf_model=object())
    assert isinstance(note, str) and "no continuous batching" in note
