"""``weft bench profile --step-phases``: self-time arithmetic, and a run on a tiny model."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.bench import step_phases, step_shapes
from tests.tiny_model import build_tiny_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_nested_phases_report_self_time(monkeypatch):
    """A phase's own time excludes the phases it calls; a fake clock makes it exact."""
    ticks = itertools.count()
    monkeypatch.setattr(step_phases.time, "perf_counter", lambda: float(next(ticks)))
    clock = step_phases.PhaseClock()
    inner = clock.wrap("inner", lambda: next(ticks))  # 1 tick of work inside
    outer = clock.wrap("outer", lambda: [inner(), inner()])
    outer()
    # outer starts at 0 and stops at 7; the inner calls span [1, 3] and [4, 6].
    assert clock.self_s == {"inner": 4.0, "outer": 3.0}


def test_a_failing_phase_still_counts_and_unwinds(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(step_phases.time, "perf_counter", lambda: float(next(ticks)))
    clock = step_phases.PhaseClock()

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        clock.wrap("fails", fail)()
    clock.wrap("after", lambda: None)()
    assert clock.self_s == {"fails": 1.0, "after": 1.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def llm(tiny):
    from services import LLM

    llm = LLM(model=tiny, dtype="float32", max_model_len=256, num_threads=1)
    yield llm
    llm.shutdown()


@pytest.fixture
def shapes(monkeypatch):
    monkeypatch.setattr(
        step_shapes,
        "SHAPES",
        {"decode-4": (4, 16, 3), "prefill-64": (1, 64, 1), "repeat-1": (1, 64, 4)},
    )


@pytest.mark.slow
def test_step_phases_on_a_tiny_model(llm, shapes):
    decode, prefill = step_phases.measure_shapes(llm, ["decode-4", "prefill-64"], rounds=2)
    assert decode["steps"] == 6 and decode["tokens"] == 4 * 6  # 4 sequences, one token each step
    assert prefill["steps"] == 2
    for shape in (decode, prefill):
        phases = shape["phases_ms"]
        named = {"schedule", "forward", "logits", "sampler", "step inputs", "update_from_output"}
        assert named <= set(phases)
        assert all(ms >= 0 for ms in phases.values())
        # Self times add up to the whole step (other = what no phase covers).
        assert sum(phases.values()) == pytest.approx(shape["step_ms_mean"], rel=1e-6)
        assert shape["step_over_forward"] > 1
    report = {"engine_args": {"model": "tiny"}, "dtype": "float32", "shapes": [decode, prefill]}
    text = step_phases.format_report(report)
    assert "decode-4" in text and "step/forward" in text


@pytest.mark.slow
def test_instrumentation_is_removed_after(llm):
    from services.worker import model_runner

    runner = llm.engine.executor.worker.model_runner
    sampler, prepare = runner.sampler, model_runner.prepare_step
    with step_phases.instrumented(llm.engine):
        assert runner.sampler is not sampler and model_runner.prepare_step is not prepare
    assert runner.sampler is sampler and model_runner.prepare_step is prepare
    assert "_forward" not in vars(runner) and "schedule" not in vars(llm.engine.scheduler)


@pytest.mark.slow
def test_speculation_times_the_proposer(tiny, shapes):
    """With speculation on, the proposer runs after every step, and each step emits its
    sampled token plus the drafts it accepted (a random tiny model rarely accepts any)."""
    report = step_phases.run_step_phases(
        ["repeat-1"],
        rounds=2,
        model=tiny,
        dtype="float32",
        max_model_len=256,
        num_threads=1,
        speculative_config=SPEC,
    )
    (shape,) = report["shapes"]
    assert "spec: propose" in shape["phases_ms"]
    assert shape["tokens_per_step"] == pytest.approx(1 + shape["spec_accepted"] / shape["steps"])


def test_repeat_prompts_repeat_one_span():
    """The repeat-1 shape's prompt is one 32-token span over and over: an n-gram proposer finds
    a match for any suffix of it; the decode shapes' prompts are random tokens."""
    from types import SimpleNamespace

    llm = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(vocab_size=1000)))
    (repeat,) = step_shapes.requests_for(llm, "repeat-1", 8, "t", seed=0)
    prompt = repeat.prompt_token_ids
    assert len(prompt) == step_shapes.SHAPES["repeat-1"][1]
    span = step_shapes._REPEAT_SPAN
    assert prompt == (prompt[:span] * (len(prompt) // span + 1))[: len(prompt)]
    assert len(set(prompt[:span])) > span // 2  # the span itself is random tokens
    (plain,) = step_shapes.requests_for(llm, "decode-1", 8, "t", seed=0)
    assert plain.prompt_token_ids[:span] != plain.prompt_token_ids[span : 2 * span]
