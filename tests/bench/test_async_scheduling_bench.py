"""The async-scheduling A/B bench's arithmetic and its batch loop, on a model-free engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.bench.async_scheduling import ExecuteClock, one_batch, summarize
from tests.engine_core.test_async_scheduling import make_engine


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_batch_times_the_decode_steps_and_the_executor(async_scheduling):
    engine = make_engine(async_scheduling)
    clock = ExecuteClock(engine.executor)
    try:
        result = one_batch(SimpleNamespace(engine=engine), clock, [[5, 6, 7], [8, 9]], output_len=6)
    finally:
        engine.shutdown()
    assert result["step_ms"] > 0 and result["execute_ms"] > 0
    # One prefill step, then one step per further token (the executor ran every one of them).
    assert clock.calls == 6


def test_summarize_takes_medians_and_the_per_round_speed_up():
    sync = [{"step_ms": 10.0, "execute_ms": 8.0}, {"step_ms": 20.0, "execute_ms": 16.0}]
    ahead = [{"step_ms": 5.0, "execute_ms": 5.0}, {"step_ms": 40.0, "execute_ms": 40.0}]
    summary = summarize({"sync": sync, "async": ahead})
    assert summary["sync"] == {"step_ms": 15.0, "execute_ms": 12.0, "step_over_forward": 1.25}
    assert summary["async_speedup_per_round"] == [2.0, 0.5]
    assert summary["async_speedup"] == 1.25
