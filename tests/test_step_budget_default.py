"""The step's token budget when none is asked for: 1,024 on a CPU with neither AMX nor AVX-512 VNNI
(its prefill is slow enough that a 2,048-token step stalls every stream for seconds), 2,048 elsewhere;
and, without chunked prefill, never below the longest prompt a request may hold.

The CPU's flags are fed in, never read from the machine the tests run on.
"""

from __future__ import annotations

import argparse

import pytest

from kernels import cpu_caps
from services.config.cli_args import add_engine_args, engine_args_from
from services.config.engine_args import AVX2_STEP_BUDGET, DEFAULT_STEP_BUDGET, EngineArgs, default_step_budget
from tests.test_dtype_auto import AMX, AVX2_ONLY, AVX512_BF16, AVX512_NO_BF16


@pytest.mark.parametrize(
    "flags, budget",
    [(AVX2_ONLY, 1024), (set(), 1024), (AVX512_NO_BF16, 2048), (AVX512_BF16, 2048), (AMX, 2048)],
    ids=["avx2", "none", "avx512-vnni", "avx512-bf16", "amx"],
)
def test_the_cpu_budget_follows_the_flags(flags, budget):
    assert (AVX2_STEP_BUDGET, DEFAULT_STEP_BUDGET) == (1024, 2048)
    assert default_step_budget("cpu", flags) == budget
    assert default_step_budget("cuda", flags) == 2048


def budget_of(monkeypatch, flags: set[str], *argv: str) -> int:
    monkeypatch.setattr(cpu_caps, "cpu_flags", lambda: set(flags))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_args_from(parser.parse_args(["--device", "cpu", *argv])).create_engine_config()
    return config.scheduler.max_num_batched_tokens


def test_an_unset_budget_comes_from_the_cpu(monkeypatch):
    assert budget_of(monkeypatch, AVX2_ONLY) == 1024
    assert budget_of(monkeypatch, AMX) == 2048


def test_an_asked_budget_is_kept(monkeypatch):
    assert budget_of(monkeypatch, AVX2_ONLY, "--max-num-batched-tokens", "4096") == 4096
    assert budget_of(monkeypatch, AMX, "--max-num-batched-tokens", "512") == 512


def test_without_chunked_prefill_the_default_budget_holds_the_longest_prompt(monkeypatch):
    budget = budget_of(monkeypatch, AVX2_ONLY, "--no-enable-chunked-prefill", "--max-model-len", "3000")
    assert budget == 3000
    assert budget_of(monkeypatch, AMX, "--no-enable-chunked-prefill", "--max-model-len", "1000") == 2048


def test_without_chunked_prefill_a_budget_below_max_model_len_is_refused():
    """Such a prompt would wait for a step with room for ever (the scheduler never splits it)."""
    args = EngineArgs(
        device="cpu", enable_chunked_prefill=False, max_model_len=3000, max_num_batched_tokens=2048
    )
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(2048\) must be at least max_model_len \(3000\)"
    ):
        args.create_engine_config()
    ok = EngineArgs(
        device="cpu", enable_chunked_prefill=False, max_model_len=3000, max_num_batched_tokens=3000
    )
    assert ok.create_engine_config().scheduler.max_num_batched_tokens == 3000
