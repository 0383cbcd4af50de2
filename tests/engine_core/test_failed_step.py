"""A step that fails to allocate memory fails only the request that caused it.

The engine (``EngineCore._step``) hands the failed step to ``Scheduler.fail_step``;
here a stand-in worker fails any step that gives one request more than ``LIMIT``
tokens, as a prompt too long for the machine's memory does. Before: the error
stopped the engine and failed every request it held.
"""

from __future__ import annotations

from protocol import FinishReason
from services.engine_core.core import is_allocation_failure
from services.engine_core.request import RequestStatus
from tests.engine_core.fakes import FakeWorker, add, make_scheduler, tokens_of

LIMIT = 40
EXPECTED = [1000 + i for i in range(8)]  # what FakeWorker samples, preempted or not


class AllocationFailed(MemoryError):
    pass


def engine_step(s, w, limit: int = LIMIT):
    """One step as EngineCore runs it: (scheduler output, engine outputs, whether it failed)."""
    so = s.schedule()
    if max(so.num_scheduled_tokens.values(), default=0) > limit:
        s.fail_step(so, "AllocationFailed: injected")
        return so, s.take_error_outputs(), True
    return so, s.update_from_output(so, w.execute(so)), False


def run(s, w, max_steps: int = 200, limit: int = LIMIT):
    seen: dict[str, list] = {}
    failed_steps = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        so, outputs, failed = engine_step(s, w, limit)
        if failed:
            failed_steps.append(dict(so.num_scheduled_tokens))
        for output in outputs:
            seen.setdefault(output.request_id, []).append(output)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.all_blocks_free()
    return seen, failed_steps


def test_a_request_alone_in_a_failed_step_fails_and_the_engine_serves_on():
    s, w = make_scheduler(), FakeWorker(16)
    add(s, "huge", 100)
    seen, failed_steps = run(s, w)
    assert failed_steps == [{"huge": 100}]  # failed once, never retried
    (last,) = seen["huge"]
    assert last.finish_reason == FinishReason.ERROR and last.error_is_internal
    assert "could not allocate" in last.error and "AllocationFailed" in last.error
    add(s, "next", 10)
    seen, failed_steps = run(s, w)
    assert failed_steps == [] and tokens_of(seen["next"]) == EXPECTED


def test_in_a_shared_step_each_request_runs_alone_once_and_only_the_culprit_fails():
    s, w = make_scheduler(), FakeWorker(16)
    add(s, "short", 10)
    _, first, _ = engine_step(s, w)  # "short" runs: it is decoding when the big prompt arrives
    add(s, "huge", 100)
    add(s, "other", 12)
    seen, failed_steps = run(s, w)
    # The shared step failed; then each of its requests ran alone ("short" recomputing its
    # 11 tokens), and only "huge" failed again.
    assert failed_steps == [{"short": 1, "huge": 100, "other": 12}, {"huge": 100}]
    seen["short"] = first + seen["short"]
    assert seen["huge"][-1].finish_reason == FinishReason.ERROR
    assert tokens_of(seen["short"]) == EXPECTED and tokens_of(seen["other"]) == EXPECTED
    assert s.make_stats().num_preemptions >= 1


def test_a_request_in_two_failed_steps_gives_up_instead_of_retrying_for_ever():
    s, w = make_scheduler(), FakeWorker(16)
    a, b = add(s, "a", 30), add(s, "b", 30)
    # Every step of more than 20 tokens for a request fails: the shared prefill fails, then
    # each one, alone, fails too: each is failed after one retry.
    seen, failed_steps = run(s, w, limit=20)
    assert failed_steps == [{"a": 30, "b": 30}, {"a": 30}, {"b": 30}]
    assert a.status == b.status == RequestStatus.FINISHED_ERROR
    assert all(seen[r][-1].finish_reason == FinishReason.ERROR for r in "ab")


def test_a_failed_steps_blocks_leave_the_prefix_cache():
    """Blocks are published when allocated: the failed step never wrote their KV, so a
    later request with the same prompt must not hit them."""
    s, w = make_scheduler(), FakeWorker(16)
    prompt = list(range(500, 564))
    add(s, "first", prompt)
    run(s, w, limit=50)  # fails alone
    add(s, "again", prompt)
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit on garbage


def test_allocation_failures_are_told_from_other_errors():
    assert is_allocation_failure(MemoryError())
    assert is_allocation_failure(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
            "can't allocate memory: you tried to allocate 99 bytes"
        )
    )
    assert is_allocation_failure(type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory."))
    assert not is_allocation_failure(RuntimeError("shape mismatch"))
    assert not is_allocation_failure(ValueError("out of memory"))
