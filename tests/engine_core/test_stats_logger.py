"""The engine's periodic log line and its speculative-decoding summary."""

from __future__ import annotations

import logging

import pytest

from protocol import SchedulerStats
from services.engine_core.stats_logger import EngineStatsLogger, SpecDecodingCounts


def spec_stats(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], **kwargs) -> SchedulerStats:
    return SchedulerStats(
        spec_decode_num_drafts=drafts,
        spec_decode_num_draft_tokens=draft_tokens,
        spec_decode_num_accepted_tokens=accepted,
        spec_decode_num_accepted_tokens_per_pos=per_pos,
        **kwargs,
    )


def test_counts_add_up_and_give_the_rates() -> None:
    counts = SpecDecodingCounts()
    counts.add(spec_stats(2, 8, 5, [2, 2, 1, 0]))
    counts.add(spec_stats(2, 6, 1, [1, 0, 0]))
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (4, 14, 6)
    assert counts.accepted_per_pos == [3, 2, 1, 0]
    assert counts.acceptance_rate == pytest.approx(6 / 14)
    assert counts.mean_accepted_length == pytest.approx(1 + 6 / 4)
    assert counts.per_position_rates() == [0.75, 0.5, 0.25, 0.0]
    assert SpecDecodingCounts().acceptance_rate == 0.0 and SpecDecodingCounts().mean_accepted_length == 0.0


def test_one_line_per_interval_with_acceptance(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    stats_logger = EngineStatsLogger(0, spec_decode=True, interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="services.engine_core.stats_logger"):
        now[0] = 4.0
        stats_logger.observe(spec_stats(1, 4, 3, [1, 1, 1, 0], num_running_reqs=1), num_generated=4)
        assert not caplog.records  # not yet
        now[0] = 10.0
        stats_logger.observe(
            spec_stats(1, 4, 1, [1, 0, 0, 0], num_running_reqs=1, kv_cache_usage=0.5), num_generated=2
        )
    [record] = caplog.records
    line = record.getMessage()
    assert "running 1" in line and "KV cache 50.0%" in line and "generation 0.6 tokens/s" in line
    assert "acceptance rate 50.0%" in line and "mean accepted length 3.00" in line
    assert "per-position acceptance [1.000, 0.500, 0.500, 0.000]" in line
    # The interval starts afresh; the totals since start stay.
    assert stats_logger.spec_totals.num_accepted_tokens == 4


def test_no_spec_summary_without_speculation() -> None:
    stats_logger = EngineStatsLogger(3, spec_decode=False)
    assert "spec" not in stats_logger.line(SchedulerStats(), 1.0)
    assert stats_logger.line(SchedulerStats(), 1.0).startswith("Engine 003:")
