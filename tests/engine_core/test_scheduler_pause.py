"""The scheduler's side of /pause, /resume and /reset_prefix_cache, and its
tokens-per-step counts (vllm:iteration_tokens_total)."""

from __future__ import annotations

from protocol.engine import ITERATION_TOKENS_BUCKETS
from tests.engine_core.fakes import (
    FakeWorker,
    add,
    make_scheduler,
    run_to_completion,
    step,
    tokens_of,
)

SHARED = list(range(500, 548))  # three full blocks of 16


def test_paused_scheduler_schedules_nothing_and_resumes_where_it_stopped():
    s, w = make_scheduler(max_num_batched_tokens=32), FakeWorker(16)
    a = add(s, "a", 40, max_tokens=6)
    step(s, w)  # a first prefill chunk of 32 tokens
    s.paused = True
    add(s, "b", 20)
    for _ in range(3):
        so, outputs = step(s, w)
        assert so.is_empty and outputs == []
    assert a.num_computed_tokens == 32 and len(s.running) == 1 and len(s.waiting) == 1
    assert s.kv_cache_manager.get_block_ids("a")  # it keeps its blocks while paused
    s.paused = False
    # The fake worker checks every step that each request reads its own KV.
    outputs = run_to_completion(s, w)
    assert tokens_of(outputs["a"]) == [1000 + i for i in range(6)] and len(tokens_of(outputs["b"])) == 8


def test_reset_prefix_cache_forgets_prefixes_and_is_refused_while_blocks_are_in_use():
    s, w = make_scheduler(), FakeWorker(16)
    add(s, "a", SHARED + [1])
    run_to_completion(s, w)
    add(s, "running", 20)
    step(s, w)
    assert not s.kv_cache_manager.reset_prefix_cache()  # "running" holds blocks
    run_to_completion(s, w)
    assert s.kv_cache_manager.reset_prefix_cache()
    add(s, "b", SHARED + [2])
    outputs = run_to_completion(s, w)
    assert outputs["b"][-1].num_cached_tokens == 0


def test_stats_count_tokens_per_step_into_vllms_buckets():
    s, w = make_scheduler(max_num_batched_tokens=32), FakeWorker(16)
    add(s, "a", 40, max_tokens=3)
    s.make_stats()
    step(s, w)  # 32 prompt tokens
    step(s, w)  # the last 8 prompt tokens
    step(s, w)  # one decode
    stats = s.make_stats()
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[ITERATION_TOKENS_BUCKETS.index(32)] = 1
    counts[ITERATION_TOKENS_BUCKETS.index(8)] = 1
    counts[ITERATION_TOKENS_BUCKETS.index(1)] = 1
    assert (stats.iteration_tokens_counts, stats.iteration_tokens_sum) == (counts, 41)
    assert s.make_stats().iteration_tokens_counts == []  # deltas: nothing since
    s.paused = True
    step(s, w)
    assert s.make_stats().iteration_tokens_sum == 0  # a paused step ran nothing
