"""``weft bench profile --workload``: steps split by kind, on real profiler events and a tiny model."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.bench import workload_profile
from benchmarks.bench.workload import Workload, WorkloadRequest
from tests.tiny_model import build_tiny_llama

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernels with"
)


def test_a_step_with_a_multi_token_request_is_a_prefill_step():
    kind = workload_profile.step_kind
    assert kind(SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1})) == "decode"
    assert kind(SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 37})) == "prefill"


def test_ops_are_grouped_by_the_step_they_ran_in():
    x, w = torch.randn(8, 32), torch.randn(16, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(workload_profile._STEP_EVENT):  # a prefill step
            torch.nn.functional.linear(x, w)
            x * x
        with record_function(workload_profile._STEP_EVENT):  # nothing scheduled: no op, not logged
            pass
        x + x  # between steps
        with record_function(workload_profile._STEP_EVENT):  # a decode step
            x * x
            x * x
    report = workload_profile.group_by_step_kind(prof.events(), ["prefill", "decode"])
    table = report["groups"]
    prefill = {g["group"]: g for g in table["prefill"]}
    decode = {g["group"]: g for g in table["decode"]}
    assert "linear" in prefill and prefill["elementwise: mul"]["calls"] == 1
    assert decode["elementwise: mul"]["calls"] == 2 and "linear" not in decode
    assert {g["group"] for g in table["idle"]} == {"elementwise: add"}
    assert sum(g["share"] for g in table["decode"]) == pytest.approx(1.0)
    assert [(o["op"], o["calls"]) for o in report["top_ops"]["decode"]] == [("aten::mul", 2)]
    with pytest.raises(RuntimeError, match="2 profiled steps ran ops, but 1"):
        workload_profile.group_by_step_kind(prof.events(), ["prefill"])


@needs_compiler
def test_a_tiny_workload_splits_into_one_prefill_step_and_its_decode_steps(tmp_path):
    """Two prompts prefilled together in the first step, then decodes until the longer output
    is done: 1 prefill step of 50 tokens, 5 decode steps of 8 tokens in all, in both passes."""
    model = build_tiny_llama(tmp_path / "tiny")
    requests = [
        WorkloadRequest(prompt="", prompt_token_ids=list(range(first, first + n)), max_tokens=m)
        for first, n, m in ((100, 20, 4), (1000, 30, 6))  # no shared prefix: no cache hit
    ]
    report = workload_profile.run_workload_profile(
        Workload(name="tiny", requests=requests),
        model=str(model),
        dtype="float32",
        max_model_len=256,
        num_threads=1,
    )
    kinds = report["phases"]["kinds"]
    assert (kinds["prefill"]["steps"], kinds["prefill"]["tokens"]) == (1, 50)
    assert (kinds["decode"]["steps"], kinds["decode"]["tokens"]) == (5, 8)
    for kind in kinds.values():
        assert 0 < kind["forward_s"] < kind["wall_s"]
        assert sum(kind["phases_s"].values()) == pytest.approx(kind["wall_s"])
    assert {"prefill", "decode"} <= set(report["ops"]["groups"])
    assert "linear" in {g["group"] for g in report["ops"]["groups"]["decode"]}
    text = workload_profile.format_workload_profile(report)
    assert "prefill steps: 1," in text and "decode steps: 5," in text


@needs_compiler
def test_weft_bench_profile_takes_a_workload_file(tmp_path, capsys):
    import argparse
    import json

    import msgspec

    from benchmarks.bench import profile as profile_bench

    model = build_tiny_llama(tmp_path / "tiny")
    requests = [WorkloadRequest(prompt="", prompt_token_ids=list(range(200, 240)), max_tokens=3)]
    path = tmp_path / "one.json"
    path.write_bytes(msgspec.json.encode(Workload(name="one", requests=requests)))
    parser = argparse.ArgumentParser()
    profile_bench.add_arguments(parser)
    argv = ["--workload", str(path), "--model", str(model), "--dtype", "float32", "--max-model-len", "256"]
    args = parser.parse_args([*argv, "--output-json", str(tmp_path / "out.json")])
    assert profile_bench.run(args, parser) == 0
    assert "prefill steps: 1, 40 tokens" in capsys.readouterr().out
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["phases"]["kinds"]["decode"]["steps"] == 2
