from __future__ import annotations

import pytest

from protocol import EngineCoreRequest, FinishReason, SamplingParams
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request, RequestStatus
from services.engine_core.request_queue import (
    SECONDS_PER_PROMPT_TOKEN,
    FCFSRequestQueue,
    PriorityRequestQueue,
    ShortestFirstRequestQueue,
    create_request_queue,
)


def test_from_engine_core_request_copies_every_field():
    wire = EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=list(range(20)),
        sampling_params=SamplingParams(max_tokens=5),
        arrival_time=12.5,
        eos_token_id=2,
        priority=3,
        cache_salt="s",
    )
    r = Request.from_engine_core_request(wire, make_block_hasher(16))
    assert (r.request_id, r.prompt_token_ids, r.arrival_time) == ("r1", list(range(20)), 12.5)
    assert (r.eos_token_id, r.priority, r.cache_salt) == (2, 3, "s")
    assert r.sampling_params.max_tokens == 5
    assert r.status == RequestStatus.WAITING
    assert (r.num_computed_tokens, r.num_cached_tokens, r.num_preemptions) == (0, -1, 0)
    assert len(r.block_hashes) == 1


def test_token_counts_follow_appended_outputs():
    r = Request("r", [1, 2, 3], SamplingParams(), 0.0)
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    assert r.output_token_ids == [4, 5, 6]
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (6, 3, 3)
    assert r.prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "status, reason",
    [
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
        (RequestStatus.FINISHED_STOPPED, FinishReason.STOP),
        (RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT),
        (RequestStatus.FINISHED_ERROR, FinishReason.ERROR),
    ],
)
def test_finished_statuses_map_to_finish_reasons(status, reason):
    r = Request("r", [1], SamplingParams(), 0.0)
    r.status = status
    assert r.is_finished == (reason is not None)
    assert r.get_finish_reason() == reason


def _staged(request: Request, arrival: float) -> Request:
    """``request`` as if the engine had received it at ``arrival`` on its own clock (its
    arrival order and monotonic time: what queues order by)."""
    request.arrival_order, request.arrival_s = arrival, arrival
    return request


def _req(request_id: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return _staged(Request(request_id, [1], SamplingParams(), 0.0, priority=priority), arrival)


def test_fcfs_queue_order_prepend_and_remove():
    q = create_request_queue("fcfs")
    assert isinstance(q, FCFSRequestQueue) and not q
    a, b, c, d = (_req(x) for x in "abcd")
    for r in (a, b, c):
        q.add(r)
    q.prepend(d)
    assert [r.request_id for r in q] == ["d", "a", "b", "c"]
    assert q.peek() is d and q.pop() is d and len(q) == 3
    q.remove(b)
    q.remove_requests([c, d])  # d is not queued: ignored
    assert list(q) == [a]
    with pytest.raises(ValueError):
        q.remove(b)


def test_priority_queue_orders_by_priority_then_arrival_then_id():
    q = create_request_queue("priority")
    assert isinstance(q, PriorityRequestQueue)
    reqs = [_req("late", 0, 5.0), _req("low", 9, 0.0), _req("b", 0, 1.0), _req("a", 0, 1.0)]
    for r in reqs:
        q.add(r)
    assert [r.request_id for r in q] == ["a", "b", "late", "low"]
    assert q.peek().request_id == "a"
    q.remove(reqs[2])  # "b"
    with pytest.raises(ValueError):
        q.remove(reqs[2])
    assert [q.pop().request_id for _ in range(len(q))] == ["a", "late", "low"]
    assert not q


def test_priority_prepend_keeps_the_request_key():
    q = create_request_queue("priority")
    old, new = _req("old", 1, 0.0), _req("new", 1, 9.0)
    q.add(new)
    q.prepend(old)
    assert q.pop() is old


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs"):
        create_request_queue("lifo")


def test_fcfs_requeue_keeps_arrival_order_ahead_of_later_arrivals():
    q = create_request_queue("fcfs")
    first, second, late = _req("first", arrival=1.0), _req("second", arrival=2.0), _req("late", arrival=5.0)
    q.add(late)
    # Both waited off the queue and come back in the opposite order.
    q.requeue(second)
    q.requeue(first)
    assert [r.request_id for r in q] == ["first", "second", "late"]
    q.requeue(_req("last", arrival=9.0))
    assert [r.request_id for r in q][-1] == "last"


def test_priority_requeue_keeps_arrival_order_within_a_priority():
    q = create_request_queue("priority")
    q.add(_req("late", 0, 5.0))
    q.requeue(_req("second", 0, 2.0))
    q.requeue(_req("first", 0, 1.0))
    assert [r.request_id for r in q] == ["first", "second", "late"]


def _prompt(request_id: str, num_tokens: int, arrival: float, priority: int = 0) -> Request:
    return _staged(Request(request_id, [1] * num_tokens, SamplingParams(), 0.0, priority=priority), arrival)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "shortest-first"])
def test_a_clock_stepped_back_does_not_let_new_arrivals_jump_the_queue(policy):
    """The wire's arrival_time is the front end's wall clock: stepped back an hour between
    two arrivals, the second still queues behind the first (and a requeue keeps that)."""
    q = create_request_queue(policy)
    first = Request("first", [1] * 10, SamplingParams(), 1_700_003_600.0)
    second = Request("second", [1] * 10, SamplingParams(), 1_700_000_000.0)  # the clock went back
    q.add(second)
    q.requeue(first)  # it waited off the queue (its grammar compiling) and comes back
    assert [r.request_id for r in q] == ["first", "second"]
    assert first.arrival_order < second.arrival_order and first.arrival_s <= second.arrival_s


def test_shortest_first_orders_a_burst_by_prompt_length():
    q = create_request_queue("shortest-first")
    assert isinstance(q, ShortestFirstRequestQueue)
    # Arrived together (priority is not this policy's order): shortest first, ties by id.
    for r in (_prompt("long", 500, 0.0), _prompt("mid", 100, 0.0, priority=-5), _prompt("b", 10, 0.0)):
        q.add(r)
    q.add(_prompt("a", 10, 0.0))
    assert [r.request_id for r in q] == ["a", "b", "mid", "long"]
    assert [q.pop().request_id for _ in range(4)] == ["a", "b", "mid", "long"]


def test_shortest_first_head_start_is_bounded_by_the_longer_prompt():
    q = create_request_queue("shortest-first")
    seconds = SECONDS_PER_PROMPT_TOKEN
    q.add(_prompt("long", 1000, 0.0))  # its key: 1000 tokens = 1 s after its arrival
    # A 10-token prompt arriving 0.98 s later still goes first (its key 0.99 s) ...
    q.add(_prompt("soon", 10, 1000 * seconds - 20 * seconds))
    # ... one arriving 1 s later, however short, queues behind the long one.
    q.add(_prompt("late", 1, 1000 * seconds))
    assert [r.request_id for r in q] == ["soon", "long", "late"]


def test_shortest_first_prepend_and_requeue_keep_the_request_key():
    q = create_request_queue("shortest-first")
    preempted, newer = _prompt("preempted", 50, 0.0), _prompt("newer", 50, 1.0)
    q.add(newer)
    q.prepend(preempted)
    q.requeue(_prompt("grammar", 50, 0.5))
    assert [r.request_id for r in q] == ["preempted", "grammar", "newer"]
