"""Scheduling decisions: budgets, chunking, ordering, prefix hits."""

from __future__ import annotations

import msgspec
import pytest

from protocol import EngineCoreRequest, SamplingParams
from services.engine_core.core import check_request
from services.engine_core.request import RequestStatus
from tests.engine_core.fakes import (
    FakeWorker,
    add,
    make_scheduler,
    run_to_completion,
    step,
    tokens_of,
)


def scheduled(so) -> dict[str, int]:
    return dict(so.num_scheduled_tokens)


def test_second_request_reuses_a_three_block_prefix():
    s, w = make_scheduler(), FakeWorker(16)
    shared = list(range(500, 548))  # 3 blocks of 16
    add(s, "a", shared + [1, 2, 3, 4, 5])
    first = run_to_completion(s, w)
    assert first["a"][-1].num_cached_tokens == 0

    add(s, "b", shared + [9] * 12)
    so, _ = step(s, w)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 48
    assert scheduled(so) == {"b": 12}  # only the rest of the prompt
    assert len(new.block_ids) == 4  # 3 shared + 1 fresh
    outputs = run_to_completion(s, w)
    assert all(o.num_cached_tokens == 48 for o in outputs["b"])
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (53 + 60, 48)


def test_running_requests_share_blocks_of_a_common_prefix():
    s, w = make_scheduler(max_num_batched_tokens=64), FakeWorker(16)
    shared = list(range(500, 548))
    add(s, "a", shared + [1])
    step(s, w)  # "a" computes all 49 prompt tokens, its blocks are cached
    add(s, "b", shared + [2])
    so, _ = step(s, w)
    assert scheduled(so) == {"a": 1, "b": 1}
    (new,) = so.scheduled_new_reqs
    assert new.block_ids[:3] == s.kv_cache_manager.get_block_ids("a")[:3]
    run_to_completion(s, w)


def test_cache_salt_isolates_prefixes():
    s, w = make_scheduler(), FakeWorker(16)
    prompt = list(range(500, 540))
    add(s, "a", prompt, cache_salt="alice")
    run_to_completion(s, w)
    add(s, "b", prompt, cache_salt="bob")
    add(s, "c", prompt)
    add(s, "d", prompt, cache_salt="alice")
    so, _ = step(s, w)
    hits = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    assert hits == {"b": 0, "c": 0, "d": 32}
    run_to_completion(s, w)


def test_last_prompt_token_is_always_computed():
    s, w = make_scheduler(), FakeWorker(16)
    prompt = list(range(500, 548))  # exactly three blocks
    add(s, "a", prompt)
    run_to_completion(s, w)
    add(s, "b", prompt)
    so, _ = step(s, w)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert scheduled(so) == {"b": 16}
    run_to_completion(s, w)


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks():
    s, w = make_scheduler(max_num_batched_tokens=32), FakeWorker(16)
    add(s, "a", 100, max_tokens=2)
    chunks, new_blocks, outputs = [], [], []
    for _ in range(4):
        so, out = step(s, w)
        chunks.append(scheduled(so)["a"])
        new_blocks.append(
            len(so.scheduled_cached_reqs.new_block_ids[0])
            if so.scheduled_cached_reqs.num_reqs
            else len(so.scheduled_new_reqs[0].block_ids)
        )
        outputs.append(out)
    assert chunks == [32, 32, 32, 4]
    assert new_blocks == [2, 2, 2, 1]  # the block table only grows by this step's blocks
    assert outputs[:3] == [[], [], []]  # mid-prefill: nothing to report
    assert tokens_of(outputs[3]) == [1000]
    run_to_completion(s, w)


def test_long_prefill_threshold_caps_every_chunk():
    s, w = make_scheduler(long_prefill_token_threshold=24), FakeWorker(16)
    add(s, "a", 60)
    add(s, "b", 30)
    so, _ = step(s, w)
    assert scheduled(so) == {"a": 24, "b": 24}
    so, _ = step(s, w)
    assert scheduled(so) == {"a": 24, "b": 6}
    so, _ = step(s, w)
    assert scheduled(so) == {"a": 12, "b": 1}
    run_to_completion(s, w)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_in_order():
    s, w = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False), FakeWorker(16)
    add(s, "a", 40)
    add(s, "b", 40)
    add(s, "c", 4)
    so, _ = step(s, w)
    assert scheduled(so) == {"a": 40}  # "b" does not fit, and "c" may not jump it
    so, _ = step(s, w)
    assert scheduled(so) == {"a": 1, "b": 40, "c": 4}
    run_to_completion(s, w)


def test_max_num_seqs_is_honoured():
    s, w = make_scheduler(max_num_seqs=2), FakeWorker(16)
    for name in "abcde":
        add(s, name, 8, max_tokens=3)
    so, _ = step(s, w)
    assert set(scheduled(so)) == {"a", "b"}
    assert s.get_request_counts() == (2, 3)
    seen_together = []
    while s.has_unfinished_requests():
        so, _ = step(s, w)
        seen_together.append(len(so.num_scheduled_tokens))
    assert max(seen_together) == 2
    assert s.kv_cache_manager.all_blocks_free()


def test_decodes_are_scheduled_before_waiting_prefills():
    s, w = make_scheduler(max_num_batched_tokens=16), FakeWorker(16)
    add(s, "a", 16)
    step(s, w)
    add(s, "b", 40)
    so, _ = step(s, w)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]
    run_to_completion(s, w)


def test_progress_is_advanced_at_schedule_time():
    s = make_scheduler()
    r = add(s, "a", 20)
    so = s.schedule()
    assert r.num_computed_tokens == 20 and r.status == RequestStatus.RUNNING
    # Its sampled token is not back yet: nothing to run for it.
    assert s.schedule().is_empty
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.all_blocks_free()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_finished_ids_are_reported_once_in_the_next_step():
    s, w = make_scheduler(), FakeWorker(16)
    add(s, "a", 5, max_tokens=1)
    add(s, "b", 5, max_tokens=3)
    _, outputs = step(s, w)
    assert [o.request_id for o in outputs if o.finished] == ["a"]
    so, _ = step(s, w)
    assert so.finished_req_ids == ["a"]
    so, _ = step(s, w)
    assert so.finished_req_ids == []
    run_to_completion(s, w)


@pytest.mark.parametrize("prompt, n", [([], 1), (list(range(64)), 1), ([1, 999], 1), ([1, 2], 2)])
def test_unservable_requests_are_refused_by_the_engines_one_check(prompt, n):
    request = EngineCoreRequest("a", prompt, SamplingParams(n=n), 0.0)
    with pytest.raises(ValueError, match="prompt|Prompt|n=1"):
        check_request(request, max_model_len=64, vocab_size=100)
    check_request(
        msgspec.structs.replace(request, prompt_token_ids=[1, 2], sampling_params=SamplingParams()),
        max_model_len=64,
        vocab_size=100,
    )


def test_duplicate_request_ids_are_refused():
    s = make_scheduler()
    add(s, "a", 4)
    with pytest.raises(ValueError, match="already"):
        add(s, "a", 4)
