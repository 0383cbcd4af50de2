"""``weft bench profile``: op grouping on real profiler events, and a fused off/on run on a tiny model."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench import profile as profile_bench
from benchmarks.bench import step_shapes
from kernels import cpu_fused
from tests.tiny_model import build_tiny_llama

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernels with"
)


@needs_compiler
def test_breakdown_groups_real_profiler_events():
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.nn.functional.linear(x, w)
        for _ in range(3):
            x * x
        x + x
        cpu_fused.rms_norm(x, torch.ones(32), 1e-5)
    groups, ops = profile_bench.breakdown(prof.key_averages())
    assert {"aten::mul", "weft_fused::rms_norm"} <= {o["op"] for o in ops}
    by_name = {g["group"]: g for g in groups}
    assert by_name["elementwise: mul"]["calls"] == 3
    assert by_name["elementwise: add"]["calls"] == 1
    assert by_name["fused CPU kernels"]["calls"] == 1
    assert "linear" in by_name
    assert sum(g["share"] for g in groups) == pytest.approx(1.0)
    assert [g["self_ms"] for g in groups] == sorted((g["self_ms"] for g in groups), reverse=True)


def test_unknown_ops_fall_in_other():
    assert profile_bench.group_of("aten::frobnicate") == "other"
    assert profile_bench.group_of("weft_fused::anything") == "fused CPU kernels"
    # The int8 dense copy's passes are its matmul's, not element-wise kernels.
    assert profile_bench.group_of("weft_fused::quantize_rows_int8") == "linear"
    assert profile_bench.group_of("aten::_int_mm") == "linear"


@needs_compiler
def test_fused_off_then_on_in_one_process(tmp_path, monkeypatch):
    """The off run does RMSNorm as torch ops; the on run calls the fused kernels instead, per layer."""
    model = build_tiny_llama(tmp_path / "tiny")
    monkeypatch.setattr(step_shapes, "SHAPES", {"decode-4": (4, 16, 2), "prefill-64": (1, 64, 1)})
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "1")
    try:
        report = profile_bench.run_profile(
            ["decode-4", "prefill-64"],
            "both",
            model=str(model),
            dtype="float32",
            max_model_len=256,
            num_threads=1,
        )
    finally:
        cpu_fused.available.cache_clear()
    off, on = report["runs"]
    assert (off["fused"], on["fused"]) == (False, True)
    for shape_off, shape_on in zip(off["shapes"], on["shapes"]):
        groups_off = {g["group"]: g for g in shape_off["groups"]}
        groups_on = {g["group"]: g for g in shape_on["groups"]}
        assert "fused CPU kernels" not in groups_off
        # Per step: 2 layers x (2 norms + rotary + SiLU-and-mul) + the final norm + the greedy argmax.
        assert groups_on["fused CPU kernels"]["calls"] == 10 * shape_on["steps"]
        norm_ops = "elementwise: RMSNorm (pow/mean/rsqrt)"
        assert groups_off[norm_ops]["calls"] >= 3 * 5 * shape_off["steps"]  # pow, mean, rsqrt of each norm
        assert groups_on.get(norm_ops, {"calls": 0})["calls"] < groups_off[norm_ops]["calls"]
        assert shape_on["step_ms"] > 0
    text = profile_bench.format_profile(report)
    assert "fused on / off" in text and "prefill-64" in text
