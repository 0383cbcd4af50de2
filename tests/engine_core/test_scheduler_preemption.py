"""Preemption by recompute when the KV pool runs out of blocks."""

from __future__ import annotations

from services.engine_core.request import RequestStatus
from tests.engine_core.fakes import FakeWorker, add, make_scheduler, run_to_completion, step, tokens_of

EXPECTED = [1000 + i for i in range(8)]  # what FakeWorker samples, preempted or not


def collect(outputs, into):
    for output in outputs:
        into.setdefault(output.request_id, []).append(output)


def test_fcfs_preempts_the_last_running_request_and_resumes_it_as_new():
    s, w = make_scheduler(num_blocks=5), FakeWorker(16)  # 4 usable blocks
    add(s, "a", 30)
    b = add(s, "b", 30)
    seen: dict[str, list] = {}
    for _ in range(3):  # both prefill (2 blocks each), then decode to 33 tokens
        so, outputs = step(s, w)
        assert so.preempted_req_ids == []
        collect(outputs, seen)

    so, outputs = step(s, w)  # "a" needs a third block: "b" makes room
    collect(outputs, seen)
    assert so.preempted_req_ids == ["b"]
    assert dict(so.num_scheduled_tokens) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.kv_cache_manager.get_block_ids("b") == []
    assert s.get_request_counts() == (1, 1)
    assert s.make_stats().num_preemptions == 1

    resumed = None
    while resumed is None:
        so, outputs = step(s, w)
        collect(outputs, seen)
        resumed = next((n for n in so.scheduled_new_reqs if n.req_id == "b"), None)
    assert resumed.output_token_ids == [1000, 1001, 1002]
    assert resumed.block_ids == s.kv_cache_manager.get_block_ids("b")
    assert len(resumed.block_ids) == 3  # the whole table for 33 tokens
    # Its own first block survived in the cache (lazy eviction).
    assert resumed.num_computed_tokens == 16
    for request_id, outputs in run_to_completion(s, w).items():
        seen.setdefault(request_id, []).extend(outputs)
    assert tokens_of(seen["a"]) == EXPECTED
    assert tokens_of(seen["b"]) == EXPECTED


def test_preempted_requests_go_to_the_front_of_the_queue():
    s, w = make_scheduler(num_blocks=5, max_num_seqs=2), FakeWorker(16)
    add(s, "a", 30)
    add(s, "b", 30)
    add(s, "c", 4)  # blocked by max_num_seqs
    for _ in range(4):
        so, _ = step(s, w)
    assert so.preempted_req_ids == ["b"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    run_to_completion(s, w)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    s, w = make_scheduler(num_blocks=5, max_num_seqs=2, scheduling_policy="priority"), FakeWorker(16)
    add(s, "x", 30, priority=0)
    add(s, "y", 30, priority=5)
    step(s, w)
    add(s, "c", 4, priority=1)  # no seat while "x" and "y" run
    for _ in range(3):
        so, _ = step(s, w)
    # "y" left: a seat and a block are free and "c" heads the queue, yet it waits.
    assert so.preempted_req_ids == ["y"] and "c" not in so.num_scheduled_tokens
    assert s.waiting.peek().request_id == "c"
    so, _ = step(s, w)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["c"]
    run_to_completion(s, w)


def _priority_scenario():
    """ "lo" runs first; "hi" and "mid" join and fill the pool (6 usable blocks)."""
    s, w = make_scheduler(num_blocks=7, scheduling_policy="priority"), FakeWorker(16)
    add(s, "lo", 20, priority=5)
    step(s, w)
    add(s, "hi", 30, priority=0)
    add(s, "mid", 30, priority=1)
    return s, w


def test_priority_preempts_the_least_important_request_even_if_already_scheduled():
    s, w = _priority_scenario()
    assert [r.request_id for r in s.running] == ["lo"]
    for _ in range(3):
        so, _ = step(s, w)
        assert so.preempted_req_ids == []
    assert [r.request_id for r in s.running] == ["lo", "hi", "mid"]
    so, _ = step(s, w)  # "hi" needs a third block; "lo" was already scheduled this step
    assert so.preempted_req_ids == ["lo"]
    assert dict(so.num_scheduled_tokens) == {"hi": 1, "mid": 1}  # "lo"'s token given back
    assert so.scheduled_cached_reqs.req_ids == ["hi", "mid"]
    assert [r.request_id for r in s.running] == ["hi", "mid"]
    outputs = run_to_completion(s, w)
    assert tokens_of(outputs["lo"])[-1] == EXPECTED[-1]


def test_priority_victim_ties_go_to_the_later_arrival():
    s, w = make_scheduler(num_blocks=5, scheduling_policy="priority"), FakeWorker(16)
    add(s, "first", 30, priority=3)
    add(s, "second", 30, priority=3)
    for _ in range(4):
        so, _ = step(s, w)
    assert so.preempted_req_ids == ["second"]
    run_to_completion(s, w)


def test_a_request_with_no_one_left_to_preempt_preempts_itself():
    s, w = make_scheduler(num_blocks=5, scheduling_policy="priority"), FakeWorker(16)
    add(s, "lo", 30, priority=9)
    add(s, "hi", 30, priority=0)
    for _ in range(3):
        step(s, w)
    assert [r.request_id for r in s.running] == ["hi", "lo"]
    so, _ = step(s, w)  # "hi" gets its block from "lo"
    assert so.preempted_req_ids == ["lo"]
    run_to_completion(s, w)


def test_blocks_of_a_request_preempted_in_its_own_step_are_not_served_from_cache():
    # Blocks are published to the prefix cache when allocated. "lo" gets its
    # fifth block filled (on paper) in the step that then preempts it, so
    # that block's KV is never written and must not be a hit later.
    s = make_scheduler(
        num_blocks=8, scheduling_policy="priority", max_num_batched_tokens=40, long_prefill_token_threshold=24
    )
    w = FakeWorker(16)
    lo = add(s, "lo", 90, priority=5)
    step(s, w)
    add(s, "hi", 15, priority=0)
    for _ in range(2):
        so, _ = step(s, w)
    so, _ = step(s, w)
    assert dict(so.num_scheduled_tokens) == {"hi": 1} and so.preempted_req_ids == ["lo"]
    assert lo.num_computed_tokens == 0
    seen: dict[str, list] = {}
    while not so.scheduled_new_reqs:  # "lo" fits again once "hi" is done
        so, outputs = step(s, w)  # FakeWorker checks the KV of every hit
        collect(outputs, seen)
    (resumed,) = so.scheduled_new_reqs
    assert resumed.req_id == "lo" and resumed.num_computed_tokens == 64  # not 80
    for request_id, outputs in run_to_completion(s, w).items():
        seen.setdefault(request_id, []).extend(outputs)
    assert tokens_of(seen["lo"]) == EXPECTED


def test_prefix_cache_stats_count_only_a_requests_first_lookup():
    # As in the test above, "b" is preempted and looks its prompt up again on
    # resuming (finding its own first block): that second lookup is no query.
    s, w = make_scheduler(num_blocks=5), FakeWorker(16)
    add(s, "a", 30)
    add(s, "b", 30)
    queries = hits = 0
    while s.has_unfinished_requests():
        step(s, w)
        stats = s.make_stats()
        queries, hits = queries + stats.prefix_cache_queries, hits + stats.prefix_cache_hits
    assert (queries, hits) == (60, 0)
