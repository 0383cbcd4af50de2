"""Concurrent partial prefills: which prompts start in which step under
max_num_partial_prefills / max_long_partial_prefills / long_prefill_token_threshold."""

from __future__ import annotations

import pytest

from services.config.engine_args import EngineArgs
from tests.engine_core.fakes import FakeWorker, add, make_request, make_scheduler, run_to_completion, step


def scheduled(so) -> dict[str, int]:
    return dict(so.num_scheduled_tokens)


def limited(**kwargs):
    kwargs.setdefault("max_num_batched_tokens", 128)
    kwargs.setdefault("long_prefill_token_threshold", 32)
    return make_scheduler(**kwargs), FakeWorker(16)


def test_short_prompts_start_ahead_of_a_long_one_held_back():
    s, w = limited(max_num_partial_prefills=4, max_long_partial_prefills=1)
    add(s, "long1", 100)
    add(s, "long2", 100)
    add(s, "short1", 20)
    add(s, "short2", 20)
    so, _ = step(s, w)
    # long2 would be a second long prefill: short1 and short2 behind it go first.
    assert scheduled(so) == {"long1": 32, "short1": 20, "short2": 20}
    assert [r.request_id for r in s.waiting] == ["long2"]
    so, _ = step(s, w)
    assert scheduled(so) == {"long1": 32, "short1": 1, "short2": 1}
    so, _ = step(s, w)
    assert scheduled(so) == {"long1": 32, "short1": 1, "short2": 1}  # 36 left: still long
    so, _ = step(s, w)
    # long1 has 4 tokens left, no longer long: long2 may start.
    assert scheduled(so) == {"long1": 4, "short1": 1, "short2": 1, "long2": 32}
    outputs = run_to_completion(s, w)
    assert set(outputs) == {"long1", "long2", "short1", "short2"}


def test_the_default_keeps_queue_order():
    s, w = limited()  # max_num_partial_prefills = 1: the limits are off
    add(s, "long1", 100)
    add(s, "long2", 100)
    add(s, "short1", 20)
    so, _ = step(s, w)
    assert scheduled(so) == {"long1": 32, "long2": 32, "short1": 20}
    run_to_completion(s, w)


def test_partial_limit_holds_back_prompts_the_step_would_leave_unfinished():
    s, w = limited(max_num_partial_prefills=2, max_long_partial_prefills=2, long_prefill_token_threshold=16)
    for name in ("a", "b", "c"):
        add(s, name, 30)
    add(s, "tiny", 10)
    so, _ = step(s, w)
    # a and b are the two partial prefills; c would be a third; tiny finishes in this step.
    assert scheduled(so) == {"a": 16, "b": 16, "tiny": 10}
    assert [r.request_id for r in s.waiting] == ["c"]
    so, _ = step(s, w)
    # a and b finish (14 left, under the threshold): c may start as a partial prefill.
    assert scheduled(so) == {"a": 14, "b": 14, "tiny": 1, "c": 16}
    run_to_completion(s, w)


def test_a_prompt_cut_by_the_budget_counts_as_partial():
    s, w = limited(
        max_num_batched_tokens=40,
        max_num_partial_prefills=2,
        max_long_partial_prefills=2,
        long_prefill_token_threshold=16,
    )
    add(s, "a", 30)
    add(s, "b", 30)
    add(s, "c", 12)  # short, but only 8 tokens of budget are left for it: a third partial prefill
    add(s, "d", 5)
    so, _ = step(s, w)
    assert scheduled(so) == {"a": 16, "b": 16, "d": 5}
    so, _ = step(s, w)
    # a and b finish, so c may be cut by the budget now.
    assert scheduled(so) == {"a": 14, "b": 14, "d": 1, "c": 11}
    run_to_completion(s, w)


def test_passed_over_prompts_keep_their_order_under_priority():
    s, w = limited(max_num_partial_prefills=2, max_long_partial_prefills=1, scheduling_policy="priority")
    add(s, "long_a", 100, priority=0)
    add(s, "long_b", 90, priority=1)
    add(s, "long_c", 80, priority=2)
    add(s, "short", 10, priority=3)
    so, _ = step(s, w)
    assert scheduled(so) == {"long_a": 32, "short": 10}
    assert [r.request_id for r in s.waiting] == ["long_b", "long_c"]
    run_to_completion(s, w)


def _config(**kwargs):
    return EngineArgs(**kwargs).create_engine_config().scheduler


def test_the_threshold_defaults_to_four_percent_of_max_model_len_when_the_limits_are_on():
    assert _config(max_num_partial_prefills=2, max_model_len=2000).long_prefill_token_threshold == 80
    assert _config(max_model_len=2000).long_prefill_token_threshold == 0
    given = _config(max_num_partial_prefills=2, max_model_len=2000, long_prefill_token_threshold=50)
    assert given.long_prefill_token_threshold == 50


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
        ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "max_long_partial_prefills"),
        ({"max_long_partial_prefills": 0}, "max_long_partial_prefills"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ],
)
def test_bad_limits_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        _config(**kwargs)


def _burst(s, lengths: dict[str, int]) -> None:
    """Requests that arrived together (the fakes space arrivals 1 s apart)."""
    for name, length in lengths.items():
        request = make_request(s, name, length)
        request.arrival_s = 0.0
        s.add_request(request)


@pytest.mark.parametrize(
    "policy, first_step",
    [
        # The budget (128) goes to the two short prompts, then the 60-token one, then a chunk of the long.
        ("shortest-first", {"short_a": 20, "short_b": 20, "mid": 60, "long": 28}),
        ("fcfs", {"long": 100, "mid": 28}),  # queue order: the long prompt takes most of the step
    ],
)
def test_shortest_first_prefills_a_burst_shortest_prompt_first(policy, first_step):
    s, w = make_scheduler(scheduling_policy=policy, max_num_batched_tokens=128), FakeWorker(16)
    _burst(s, {"long": 100, "mid": 60, "short_a": 20, "short_b": 20})
    so, _ = step(s, w)
    assert scheduled(so) == first_step
    outputs = run_to_completion(s, w)
    assert set(outputs) == {"long", "mid", "short_a", "short_b"}


def test_an_unknown_scheduling_policy_is_refused_naming_the_three():
    with pytest.raises(ValueError, match="fcfs, priority, shortest-first"):
        _config(scheduling_policy="sjf")
    assert _config(scheduling_policy="shortest-first").scheduling_policy == "shortest-first"


def beside_decodes(room: int):
    """The CPU's automatic chunk cap (32 here): a prompt's chunk and, while a request is past its
    prompt, every prompt's tokens in a step together."""
    scheduler = make_scheduler(
        max_num_batched_tokens=256, long_prefill_token_threshold=32, prefill_tokens_beside_decodes=room
    )
    return scheduler, FakeWorker(16)


def test_prompts_arriving_beside_a_stream_take_the_room_between_them():
    s, w = beside_decodes(32)
    add(s, "stream", 10, max_tokens=200, ignore_eos=True)
    so, _ = step(s, w)
    assert scheduled(so) == {"stream": 10}  # nothing decodes yet: the budget's
    for name in ("long1", "long2", "long3"):
        add(s, name, 100)
    so, _ = step(s, w)
    # Without the room each long prompt would take a 32-token chunk (97 tokens in the step).
    assert scheduled(so) == {"stream": 1, "long1": 32}
    so, _ = step(s, w)
    assert scheduled(so) == {"stream": 1, "long1": 32}
    for _ in range(20):
        so, _ = step(s, w)
        # Past their prompts the long ones decode a token a step (no chunk here is 1 token).
        prompt_tokens = sum(n for n in scheduled(so).values() if n > 1)
        assert prompt_tokens <= 32 and scheduled(so).get("stream") == 1
    run_to_completion(s, w)
    assert not s.has_unfinished_requests() and s.kv_cache_manager.all_blocks_free()


def test_without_a_stream_past_its_prompt_a_burst_takes_the_budget():
    s, w = beside_decodes(32)
    for name in ("long1", "long2", "long3"):
        add(s, name, 100)
    so, _ = step(s, w)
    assert scheduled(so) == {"long1": 32, "long2": 32, "long3": 32}  # each capped, none beside decodes
    so, _ = step(s, w)
    assert scheduled(so) == {"long1": 32, "long2": 32, "long3": 32}


def test_no_room_set_keeps_each_prompts_own_chunk():
    s, w = beside_decodes(0)
    add(s, "stream", 10)
    step(s, w)
    for name in ("long1", "long2"):
        add(s, name, 100)
    so, _ = step(s, w)
    assert scheduled(so) == {"stream": 1, "long1": 32, "long2": 32}


def test_a_resumed_request_computing_its_outputs_again_takes_the_room_too():
    """After a preemption a request computes its outputs again: with its prompt (and some outputs)
    found in the prefix cache it starts past its prompt, but those tokens cost the stream beside it
    as much as a prompt's, so they are held to the room (catch_up_end) as prompt tokens are."""
    s, w = beside_decodes(4)
    add(s, "stream", 10, max_tokens=200, ignore_eos=True)
    step(s, w)
    resumed = add(s, "resumed", 32, max_tokens=200, ignore_eos=True)
    while resumed.num_output_tokens < 40:
        so, _ = step(s, w)
        assert sum(n for rid, n in scheduled(so).items() if rid == "resumed" and n > 1) <= 4
    s._requeue_at_front(resumed)  # what a preemption does to it (the victim of a short KV pool)
    w.requests.pop("resumed")  # and the worker drops it, as the step's preempted_req_ids tell it
    assert resumed.num_computed_tokens == 0 and resumed.num_tokens - 1 > 64
    so, _ = step(s, w)
    new = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    assert new["resumed"] >= 64 > resumed.num_prompt_tokens  # found cached past its prompt
    assert scheduled(so) == {"stream": 1, "resumed": 4}  # 71 - 64 + 1 = 8 tokens left, 4 of room
    run_to_completion(s, w)
    assert not s.has_unfinished_requests() and s.kv_cache_manager.all_blocks_free()
