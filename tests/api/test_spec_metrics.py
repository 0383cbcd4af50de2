"""Speculative-decoding counters on /metrics: summed per rank from the engines' stats deltas."""

from __future__ import annotations

from protocol import SchedulerStats
from services.api.engine_client import RankStats, add_spec_decode_stats
from services.api.metrics import APIMetrics


def test_counters_are_running_totals_per_rank_and_position() -> None:
    rank = RankStats(rank=1)
    add_spec_decode_stats(
        rank,
        SchedulerStats(
            spec_decode_num_drafts=2,
            spec_decode_num_draft_tokens=8,
            spec_decode_num_accepted_tokens=5,
            spec_decode_num_accepted_tokens_per_pos=[2, 2, 1, 0],
        ),
    )
    add_spec_decode_stats(
        rank,
        SchedulerStats(
            spec_decode_num_drafts=1,
            spec_decode_num_draft_tokens=4,
            spec_decode_num_accepted_tokens=4,
            spec_decode_num_accepted_tokens_per_pos=[1, 1, 1, 1],
        ),
    )
    add_spec_decode_stats(rank, SchedulerStats())  # a heartbeat: nothing new
    text = APIMetrics(lambda: {1: rank}, "m").exposition().decode()
    labels = 'engine="1",model_name="m"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} 3.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 12.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 9.0" in text
    for position, count in enumerate([3, 3, 2, 1]):
        assert (
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{position}"}} {count}.0'
            in text
        )


def test_counters_read_zero_without_speculation() -> None:
    text = APIMetrics(lambda: {0: RankStats(rank=0)}, "m").exposition().decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 0.0' in text
    assert "spec_decode_num_accepted_tokens_per_pos_total{" not in text
