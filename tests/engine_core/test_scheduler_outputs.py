"""update_from_output: stop conditions, logprobs, aborts, stats."""

from __future__ import annotations

import pytest

from protocol import EngineCoreEventType, FinishReason, ModelRunnerOutput
from services.engine_core.request import RequestStatus
from tests.engine_core.fakes import (
    EOS,
    FakeWorker,
    add,
    fake_logprob,
    make_scheduler,
    run_to_completion,
    step,
    tokens_of,
)


def feed(s, so, sampled: dict[str, list[int]], logprobs=None, prompt_logprobs=None):
    """Hand-made model output for the scheduled requests; returns {request_id: output}."""
    req_ids = list(so.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=[sampled.get(r, []) for r in req_ids],
        logprobs=[(logprobs or {}).get(r, []) for r in req_ids],
        prompt_logprobs=prompt_logprobs or {},
    )
    return {o.request_id: o for o in s.update_from_output(so, runner_output)}


def start(**sampling):
    """A scheduler with one 4-token request "r", prefilled and waiting for its first token."""
    s = make_scheduler(max_model_len=64)
    request = add(s, "r", 4, **sampling)
    return s, request, s.schedule()


def finish(s, request) -> None:
    if not request.is_finished:
        s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.all_blocks_free()


def test_eos_stops_and_later_tokens_are_dropped():
    s, r, so = start(max_tokens=10)
    out = feed(s, so, {"r": [5, EOS, 6, 7]})["r"]
    assert out.new_token_ids == [5, EOS]
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, None)
    assert r.output_token_ids == [5, EOS] and r.status == RequestStatus.FINISHED_STOPPED
    assert not s.has_unfinished_requests()
    finish(s, r)


def test_ignore_eos_runs_to_max_tokens():
    s, r, so = start(max_tokens=3, ignore_eos=True)
    out = feed(s, so, {"r": [EOS, EOS, EOS, EOS]})["r"]
    assert out.new_token_ids == [EOS, EOS, EOS]
    assert out.finish_reason == FinishReason.LENGTH
    finish(s, r)


def test_stop_token_ids_stop_with_the_token_as_reason():
    s, r, so = start(max_tokens=10, stop_token_ids=[42, 43])
    out = feed(s, so, {"r": [5, 43, 42]})["r"]
    assert out.new_token_ids == [5, 43]
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, 43)
    finish(s, r)


def test_nothing_stops_before_min_tokens():
    s, r, so = start(max_tokens=10, min_tokens=3, stop_token_ids=[42])
    out = feed(s, so, {"r": [EOS, 42, EOS, 9]})["r"]
    assert out.new_token_ids == [EOS, 42, EOS]  # the third output may stop it
    assert out.finish_reason == FinishReason.STOP
    finish(s, r)


def test_max_tokens_caps_the_output_one_step_at_a_time():
    s, w = make_scheduler(), FakeWorker(16)
    add(s, "r", 6, max_tokens=5)
    outputs = run_to_completion(s, w)["r"]
    assert tokens_of(outputs) == [1000, 1001, 1002, 1003, 1004]
    assert [o.finish_reason for o in outputs] == [None] * 4 + [FinishReason.LENGTH]


def test_max_model_len_caps_even_before_min_tokens():
    s, w = make_scheduler(max_model_len=20), FakeWorker(16)
    add(s, "r", 16, max_tokens=None, min_tokens=0)
    add(s, "m", 16, max_tokens=10, min_tokens=10)
    outputs = run_to_completion(s, w)
    for request_id in ("r", "m"):
        assert len(tokens_of(outputs[request_id])) == 4  # 16 + 4 = max_model_len
        assert outputs[request_id][-1].finish_reason == FinishReason.LENGTH


def test_logprobs_are_trimmed_to_the_kept_tokens():
    s, r, so = start(max_tokens=10, logprobs=1)
    entries = [fake_logprob(t, i) for i, t in enumerate([5, EOS, 6])]
    out = feed(s, so, {"r": [5, EOS, 6]}, logprobs={"r": entries})["r"]
    assert out.new_logprobs == entries[:2]
    finish(s, r)


def test_outputs_carry_logprobs_and_cache_hits_end_to_end():
    s, w = make_scheduler(), FakeWorker(16)
    add(s, "r", 6, max_tokens=3, logprobs=2)
    add(s, "plain", 6, max_tokens=3)
    outputs = run_to_completion(s, w)
    assert all(len(o.new_logprobs) == 1 for o in outputs["r"])
    assert all(o.new_logprobs is None for o in outputs["plain"])


def test_mid_prefill_requests_report_only_prompt_logprobs():
    s, w = make_scheduler(max_num_batched_tokens=16), FakeWorker(16)
    add(s, "p", 40, prompt_logprobs=0, max_tokens=2)
    add(s, "q", 40, max_tokens=2)
    _, outputs = step(s, w)
    ((only,),) = [outputs]
    assert only.request_id == "p" and only.new_token_ids == []
    # 16 tokens score the 17th too: None for position 0, then positions 1..16.
    assert len(only.new_prompt_logprobs) == 17 and only.new_prompt_logprobs[0] is None
    assert only.finish_reason is None
    all_outputs = run_to_completion(s, w)
    entries = [e for o in [only, *all_outputs["p"]] for e in (o.new_prompt_logprobs or [])]
    assert [e.logprobs[0] for e in entries[1:]] == [-float(p) for p in range(1, 40)]


def test_prompt_logprobs_are_not_repeated_after_a_preemption():
    s, w = make_scheduler(num_blocks=5, max_num_batched_tokens=16), FakeWorker(16)
    add(s, "b", 15, max_tokens=8)
    step(s, w)
    add(s, "p", 40, prompt_logprobs=0, max_tokens=2)
    sent: list = []
    preempted = False
    while s.has_unfinished_requests():
        so, outputs = step(s, w)
        preempted |= "p" in so.preempted_req_ids
        sent += [e for o in outputs if o.request_id == "p" for e in o.new_prompt_logprobs or []]
    assert preempted
    assert sent[0] is None
    assert [e.logprobs[0] for e in sent[1:]] == [-float(p) for p in range(1, 40)]
    assert s.kv_cache_manager.all_blocks_free()


def test_first_output_carries_queue_and_schedule_events():
    s, w = make_scheduler(), FakeWorker(16)
    add(s, "r", 4, max_tokens=2)
    outputs = run_to_completion(s, w)["r"]
    assert [e.type for e in outputs[0].events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert outputs[1].events is None


@pytest.mark.parametrize("where", ["waiting", "running", "mid-prefill"])
def test_abort_frees_blocks_and_is_reported_once(where):
    s, w = make_scheduler(max_num_batched_tokens=16), FakeWorker(16)
    request = add(s, "r", 40)
    if where != "waiting":
        step(s, w)
    if where == "running":
        while request.num_output_tokens == 0:
            step(s, w)
    s.finish_requests(["r", "r", "unknown"], RequestStatus.FINISHED_ABORTED)
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)  # idempotent
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.get_finish_reason() == FinishReason.ABORT
    assert not s.has_unfinished_requests() and s.get_request_counts() == (0, 0)
    assert s.kv_cache_manager.all_blocks_free()
    so = s.schedule()
    assert so.finished_req_ids == ["r"] and so.is_empty
    assert s.schedule().finished_req_ids == []


def test_an_abort_between_schedule_and_update_drops_the_output():
    s, r, so = start(max_tokens=5)
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert feed(s, so, {"r": [5]}) == {}
    assert r.output_token_ids == []
    finish(s, r)


def test_finish_requests_needs_a_finished_status():
    s, r, _ = start()
    with pytest.raises(ValueError, match="finished"):
        s.finish_requests("r", RequestStatus.RUNNING)
    finish(s, r)


def test_stats_describe_the_load_and_reset_their_counters():
    s = make_scheduler(num_blocks=11, max_num_seqs=1)
    add(s, "a", 20)
    add(s, "b", 20)
    s.schedule()
    stats = s.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert (stats.num_free_blocks, stats.num_total_blocks) == (8, 10)
    assert stats.kv_cache_usage == pytest.approx(0.2)
    assert (stats.prefix_cache_queries, stats.step_counter) == (20, 1)
    assert s.make_stats().prefix_cache_queries == 0
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.all_blocks_free()
