"""The persistent batch follows SchedulerOutputs incrementally."""

from __future__ import annotations

import pytest

from protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from services.worker.input_batch import InputBatch
from services.worker.step_inputs import prepare_step

SP = SamplingParams(temperature=0.0)


def step(new=(), cached=None, scheduled=None, finished=(), preempted=()) -> SchedulerOutput:
    scheduled = scheduled or {}
    cached = CachedRequestData() if cached is None else cached
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=list(finished),
        preempted_req_ids=list(preempted),
    )


def test_add_update_append_and_drop():
    batch = InputBatch(max_num_reqs=2, max_model_len=32, block_size=4)
    batch.update(
        step(new=[NewRequestData("a", [5, 6, 7, 8, 9], SP, [3, 4], 0), NewRequestData("b", [1], SP, [7], 0)])
    )
    row = batch.requests["a"].row
    assert batch.token_ids[row, :5].tolist() == [5, 6, 7, 8, 9]
    assert batch.block_table[row, :3].tolist() == [3, 4, 0]
    batch.append_token("a", 42)
    assert batch.num_tokens[row] == 6 and batch.requests["a"].output_token_ids == [42]
    batch.update(step(cached=CachedRequestData(["a"], [[11]], [5]), finished=["b"]))
    assert "b" not in batch and len(batch) == 1
    assert batch.block_table[row, :3].tolist() == [3, 4, 11]
    assert batch.num_computed_tokens[row] == 5


def test_preempted_request_returns_as_new_with_its_outputs():
    batch = InputBatch(max_num_reqs=2, max_model_len=32, block_size=4)
    batch.update(step(new=[NewRequestData("a", [5, 6], SP, [3], 0)]))
    batch.update(step(preempted=["a"]))
    assert "a" not in batch
    batch.update(step(new=[NewRequestData("a", [5, 6], SP, [9, 10], 0, output_token_ids=[7, 8])]))
    row = batch.requests["a"].row
    assert batch.token_ids[row, :4].tolist() == [5, 6, 7, 8] and batch.num_tokens[row] == 4
    assert batch.requests["a"].output_token_ids == [7, 8]
    assert batch.block_table[row, :3].tolist() == [9, 10, 0]


def test_rows_are_recycled_and_grow_when_needed():
    batch = InputBatch(max_num_reqs=1, max_model_len=8, block_size=4)
    batch.update(step(new=[NewRequestData("a", [1], SP, [1], 0), NewRequestData("b", [2], SP, [2], 0)]))
    assert {batch.requests["a"].row, batch.requests["b"].row} == {0, 1}
    batch.update(step(finished=["a"]))
    batch.update(step(new=[NewRequestData("c", [3], SP, [3], 0)]))
    assert batch.requests["c"].row == 0


def test_too_long_a_request_is_refused():
    batch = InputBatch(max_num_reqs=1, max_model_len=4, block_size=4)
    with pytest.raises(ValueError, match="max_model_len"):
        batch.update(step(new=[NewRequestData("a", [1, 2, 3, 4, 5], SP, [1, 2], 0)]))


def test_step_inputs_flatten_chunks_and_decodes():
    batch = InputBatch(max_num_reqs=4, max_model_len=32, block_size=4)
    batch.update(
        step(
            new=[
                NewRequestData("p", list(range(100, 110)), SP, [5, 6, 7], 4),
                NewRequestData("d", [1, 2, 3], SP, [9], 0),
            ]
        )
    )
    batch.append_token("d", 50)  # "d" was prefilled earlier and sampled 50
    batch.num_computed_tokens[batch.requests["d"].row] = 3
    inputs = prepare_step(batch, ["d", "p"], {"d": 1, "p": 5}, "cpu")
    assert inputs.input_ids.tolist() == [50, 104, 105, 106, 107, 108]
    assert inputs.positions.tolist() == [3, 4, 5, 6, 7, 8]
    # slot = block * 4 + offset: "d" pos 3 -> block 9; "p" pos 4..8 -> blocks 6, 6, 6, 6, 7
    assert inputs.attn_metadata.slot_mapping.tolist() == [39, 24, 25, 26, 27, 28]
    assert inputs.samples.tolist() == [True, False]  # "p" has one prompt token left
    assert inputs.sample_token_index.tolist() == [0]
    with pytest.raises(ValueError, match="past its known tokens"):
        prepare_step(batch, ["d"], {"d": 2}, "cpu")
