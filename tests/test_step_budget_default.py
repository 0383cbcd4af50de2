"""The step's token budget when none is asked for: 1,024 on a CPU with neither AMX nor AVX-512 VNNI
(its prefill is slow enough that a 2,048-token step stalls every stream for seconds), 2,048 elsewhere;
and, without chunked prefill, never below the longest prompt a request may hold. On a CPU a model
larger than the default one takes its prompts in chunks of the budget scaled down by its size.

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


def _hf_config(shape_name: str) -> dict:
    """The HF config fields of one of ``weft bench make-model``'s shapes that count its weights."""
    from benchmarks.bench.make_model import SHAPES

    shape = SHAPES[shape_name]
    return {
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": 49152,
    }


@pytest.mark.parametrize(
    "shape, budget, cap",
    [
        ("llama-3.2-1b", 1024, 96),  # 973 M multiply-adds a token: 1,024 x 106 / 973 = 111
        ("llama-3.2-3b", 1024, 32),  # 2.82 G: 38
        ("llama-3.1-8b", 1024, 16),  # 6.98 G: 15, one grain at least
        ("llama-3.2-1b", 2048, 208),  # the budget where the CPU has AMX or AVX-512 VNNI
        ("tiny-llama", 1024, 0),  # smaller than the default model: no cap
    ],
)
def test_a_cpu_caps_a_larger_models_prompt_chunks_by_its_multiply_adds(shape, budget, cap):
    from services.config.engine_args import prefill_chunk_cap

    assert prefill_chunk_cap("cpu", _hf_config(shape), budget) == cap
    assert prefill_chunk_cap("cuda", _hf_config(shape), budget) == 0


def test_the_default_models_chunks_are_not_capped_and_a_larger_ones_are(monkeypatch):
    """The reference is the default model's own multiply-adds; a model ten times as large (the
    reference made a tenth) gets a tenth of the budget, unless the threshold is given or chunked
    prefill is off."""
    from services.config import engine_args

    budget = engine_args.default_step_budget("cpu")

    def _scheduler(**kwargs):
        return EngineArgs(**kwargs).create_engine_config().scheduler

    assert _scheduler(device="cpu").long_prefill_token_threshold == 0
    monkeypatch.setattr(
        engine_args, "REFERENCE_LAYER_MULTIPLY_ADDS", engine_args.REFERENCE_LAYER_MULTIPLY_ADDS // 10
    )
    assert _scheduler(device="cpu").long_prefill_token_threshold == budget // 10 // 16 * 16
    assert _scheduler(device="cpu", long_prefill_token_threshold=0).long_prefill_token_threshold == 0
    assert _scheduler(device="cpu", long_prefill_token_threshold=50).long_prefill_token_threshold == 50
    assert _scheduler(device="cpu", enable_chunked_prefill=False).long_prefill_token_threshold == 0
    # The automatic cap bounds a step's prompt tokens together while streams decode; given
    # thresholds (and several partial prefills) keep vLLM's per-prompt meaning alone.
    auto = _scheduler(device="cpu")
    assert auto.prefill_tokens_beside_decodes == auto.long_prefill_token_threshold > 0
    assert _scheduler(device="cpu", long_prefill_token_threshold=50).prefill_tokens_beside_decodes == 0
    several = _scheduler(device="cpu", max_num_partial_prefills=2, max_long_partial_prefills=1)
    assert several.prefill_tokens_beside_decodes == 0
