"""Pooling (embeddings) requests in the scheduler, with hand-made worker outputs: prompt-only,
chunked like any prompt, finished by the step that runs their last prompt token (with the
vector the worker pooled), their blocks freed at once; mean pooling stays off the prefix cache."""

from __future__ import annotations

import numpy as np

from protocol import FinishReason, ModelRunnerOutput, PoolingParams, PoolingType
from services.engine_core.request import Request, RequestStatus
from tests.engine_core.fakes import add, make_request, make_scheduler

HIDDEN = 8


def add_pooling(s, request_id: str, prompt, pooling_type=PoolingType.LAST) -> Request:
    plain = make_request(s, request_id, prompt)
    request = Request(
        request_id=plain.request_id,
        prompt_token_ids=plain.prompt_token_ids,
        sampling_params=plain.sampling_params,
        arrival_time=plain.arrival_time,
        block_hasher=s.block_hasher,
        pooling_params=PoolingParams(pooling_type),
    )
    s.add_request(request)
    return request


def run_step(s, pooled: dict[str, np.ndarray] | None = None, sampled: dict[str, list[int]] | None = None):
    """One step: what was scheduled, and the outputs of a worker that pooled ``pooled``."""
    so = s.schedule()
    req_ids = list(so.num_scheduled_tokens)
    pooled = pooled or {}
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=[(sampled or {}).get(r, []) for r in req_ids],
        logprobs=[[] for _ in req_ids],
        pooled_req_ids=list(pooled),
        pooled=np.stack(list(pooled.values())) if pooled else None,
    )
    return so, {o.request_id: o for o in s.update_from_output(so, runner_output)}


def test_a_pooling_request_finishes_after_its_prompt_and_frees_its_blocks():
    s = make_scheduler(num_blocks=16, max_model_len=128, max_num_batched_tokens=16)
    request = add_pooling(s, "e", 40)
    # Chunked like any prompt: 16 + 16 + 8 tokens, nothing reported mid-prefill.
    for expected in (16, 16):
        so, outputs = run_step(s)
        assert so.num_scheduled_tokens == {"e": expected}
        assert outputs == {}
        assert so.scheduled_new_reqs == [] or so.scheduled_new_reqs[0].pooling_params == PoolingParams()
    assert s.kv_cache_manager.num_free_blocks < 15
    vector = np.arange(HIDDEN, dtype=np.float32)
    so, outputs = run_step(s, pooled={"e": vector})
    assert so.num_scheduled_tokens == {"e": 8}
    out = outputs["e"]
    assert out.finish_reason == FinishReason.STOP
    assert out.new_token_ids == []
    np.testing.assert_array_equal(out.pooled, vector)
    assert request.is_finished and "e" not in s.requests
    assert s.kv_cache_manager.all_blocks_free()
    assert not s.has_unfinished_requests()
    so, _ = run_step(s)  # the worker hears that it is gone
    assert so.finished_req_ids == ["e"]
    assert so.total_num_scheduled_tokens == 0


def test_pooling_and_generation_share_a_step():
    s = make_scheduler(num_blocks=32, max_model_len=128)
    add(s, "g", 10, max_tokens=2)
    add_pooling(s, "e", 12)
    so, outputs = run_step(s, pooled={"e": np.ones(HIDDEN, np.float32)}, sampled={"g": [7]})
    assert so.num_scheduled_tokens == {"g": 10, "e": 12}
    assert outputs["e"].finished and outputs["g"].new_token_ids == [7] and not outputs["g"].finished
    so, outputs = run_step(s, sampled={"g": [8]})
    assert so.num_scheduled_tokens == {"g": 1}  # the pooling request is not scheduled again
    assert outputs["g"].finish_reason == FinishReason.LENGTH
    assert s.kv_cache_manager.all_blocks_free()


def test_last_token_pooling_uses_the_prefix_cache_and_mean_pooling_does_not():
    s = make_scheduler(num_blocks=32, max_model_len=128)
    prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks
    add_pooling(s, "first", prompt)
    run_step(s, pooled={"first": np.ones(HIDDEN, np.float32)})
    add_pooling(s, "last", prompt)
    so, _ = run_step(s, pooled={"last": np.ones(HIDDEN, np.float32)})
    assert so.num_scheduled_tokens == {"last": 8}  # 32 tokens from the cache
    add_pooling(s, "mean", prompt, PoolingType.MEAN)
    so, outputs = run_step(s, pooled={"mean": np.ones(HIDDEN, np.float32)})
    assert so.num_scheduled_tokens == {"mean": 40}  # every position computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert outputs["mean"].num_cached_tokens == 0
    assert s.kv_cache_manager.all_blocks_free()


def test_an_aborted_pooling_request_frees_its_blocks():
    s = make_scheduler(num_blocks=16, max_model_len=128, max_num_batched_tokens=16)
    add_pooling(s, "e", 40)
    run_step(s)
    s.finish_requests("e", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.all_blocks_free()
    assert not s.has_unfinished_requests()


def test_async_scheduling_neither_samples_nor_reschedules_a_pooling_request():
    """With a step in flight, the next one is scheduled before its output: a pooling request whose
    prompt is all scheduled gets no output placeholder (it samples nothing) and no more tokens."""
    s = make_scheduler(num_blocks=16, max_model_len=128, async_scheduling=True)
    request = add_pooling(s, "e", 20)
    first = s.schedule()
    assert first.num_scheduled_tokens == {"e": 20}
    assert request.num_output_placeholders == 0
    second = s.schedule()  # step 1 still running
    assert second.num_scheduled_tokens == {}
    runner_output = ModelRunnerOutput(
        req_ids=["e"],
        sampled_token_ids=[[]],
        logprobs=[[]],
        pooled_req_ids=["e"],
        pooled=np.ones((1, HIDDEN), np.float32),
    )
    (out,) = s.update_from_output(first, runner_output)
    assert out.finished and out.pooled.shape == (HIDDEN,)
    assert s.update_from_output(second, ModelRunnerOutput()) == []
    assert s.kv_cache_manager.all_blocks_free() and not s.has_unfinished_requests()
