"""Speculative decoding in the scheduler, against a fake worker.

``SpecWorker`` plays a deterministic greedy "model" (the next token is a
function of the whole context), verifies the scheduled drafts the way the
real rejection sampler does for greedy requests, and proposes the next
drafts with the real n-gram proposer. Like the plain ``FakeWorker`` it keeps
a "KV cache" of the token written at every slot and checks, every step,
that the context a request reads holds its own tokens: a rolled-back
``num_computed_tokens`` that is off by one, or a block table that lost a
block, fails there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest

from protocol import ModelRunnerOutput, SchedulerOutput, SpeculativeConfig
from services.engine_core.scheduler import Scheduler
from services.worker.spec_decode.ngram import propose_ngram
from tests.engine_core.fakes import EOS, add, make_config

K = 4


def make_spec_scheduler(num_blocks: int = 64, k: int = K, **config_kwargs) -> Scheduler:
    config = make_config(**config_kwargs)
    if k:
        spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
        config = msgspec.structs.replace(config, speculative=spec)
    return Scheduler(config, num_blocks)


def looping_model(tokens: list[int]) -> int:
    """A greedy 'model' that mostly repeats itself with period 5 (drafts often
    right), but breaks the pattern now and then (drafts sometimes wrong)."""
    n = len(tokens)
    if n % 11 == 0:
        return 500 + (sum(tokens[-3:]) % 7)
    return tokens[-5] if n >= 5 else 300 + n


@dataclass
class _State:
    tokens: list[int]
    num_computed: int
    block_ids: list[int] = field(default_factory=list)


class SpecWorker:
    def __init__(
        self, block_size: int, model=looping_model, propose: bool = True, accept: int | None = None
    ) -> None:
        self.block_size = block_size
        self.model = model
        self.propose = propose
        self.accept = accept  # force this many accepted drafts (None: verify against the model)
        self.requests: dict[str, _State] = {}
        self.kv: dict[int, int] = {}
        self.next_drafts: dict[str, list[int]] = {}  # override the proposer, per request

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.requests.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = _State(
                [*new.prompt_token_ids, *new.output_token_ids], new.num_computed_tokens, list(new.block_ids)
            )
        cached = so.scheduled_cached_reqs
        for request_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[request_id]
            assert state.num_computed == num_computed, (request_id, state.num_computed, num_computed)
            state.block_ids.extend(block_ids)
        out = ModelRunnerOutput()
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            drafts = so.scheduled_spec_decode_tokens.get(request_id, [])
            sampled = self._run(request_id, num_tokens, drafts)
            out.req_ids.append(request_id)
            out.sampled_token_ids.append(sampled)
            out.logprobs.append([])
            out.spec_token_ids.append(self._proposal(request_id) if sampled and self.propose else [])
        return out

    def _slot(self, state: _State, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _run(self, request_id: str, num_tokens: int, drafts: list[int]) -> list[int]:
        state = self.requests[request_id]
        inputs = state.tokens + drafts
        start, end = state.num_computed, state.num_computed + num_tokens
        assert end <= len(inputs), "scheduled past the known and draft tokens"
        assert not drafts or end == len(inputs), "drafts are scheduled whole, at the end"
        assert len(state.block_ids) * self.block_size >= end, "no slot for a token"
        assert 0 not in state.block_ids and len(set(state.block_ids)) == len(state.block_ids)
        for position in range(start):
            assert self.kv[self._slot(state, position)] == state.tokens[position], (request_id, position)
        for position in range(start, end):
            self.kv[self._slot(state, position)] = inputs[position]
        if end < len(inputs):
            state.num_computed = end
            return []  # mid-prefill
        emitted = self._verify(state.tokens, drafts)
        state.num_computed = len(state.tokens) + len(emitted) - 1
        state.tokens += emitted
        return emitted

    def _verify(self, tokens: list[int], drafts: list[int]) -> list[int]:
        emitted: list[int] = []
        for j, draft in enumerate(drafts):
            target = self.model(tokens + emitted)
            if self.accept is not None:
                target = draft if j < self.accept else draft + 1
            emitted.append(target)
            if target != draft:
                return emitted
        return emitted + [self.model(tokens + emitted)]

    def _proposal(self, request_id: str) -> list[int]:
        if request_id in self.next_drafts:
            return self.next_drafts.pop(request_id)
        return propose_ngram(np.array(self.requests[request_id].tokens), 1, 3, K).tolist()


def step(scheduler: Scheduler, worker: SpecWorker):
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, worker.execute(so))


def run_all(scheduler: Scheduler, worker: SpecWorker, max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = step(scheduler, worker)
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.all_blocks_free(), "a KV block leaked"
    return tokens


# ----------------------------------------------------------------- scheduling


def test_drafts_are_scheduled_counted_and_given_slots() -> None:
    scheduler = make_spec_scheduler(block_size=4)
    worker = SpecWorker(4)
    request = add(scheduler, "a", 10, max_tokens=50)
    worker.next_drafts["a"] = [7, 8, 9]
    step(scheduler, worker)  # the prefill: samples one token, proposes 3 drafts
    assert request.spec_token_ids == [7, 8, 9]
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}
    assert so.num_scheduled_tokens == {"a": 4} and so.total_num_scheduled_tokens == 4
    assert request.num_computed_tokens == 11 + 3  # advanced over the drafts too
    blocks = scheduler.kv_cache_manager.get_block_ids("a")
    assert len(blocks) * 4 >= 14


def test_rejected_drafts_roll_back_num_computed_tokens() -> None:
    scheduler = make_spec_scheduler(block_size=4)
    worker = SpecWorker(4, accept=1)
    request = add(scheduler, "a", 10, max_tokens=50)
    worker.next_drafts["a"] = [7, 8, 9]
    step(scheduler, worker)
    _, outputs = step(scheduler, worker)  # accepts 7, then replaces 8
    assert outputs[0].new_token_ids == [7, 9]
    assert request.num_tokens == 13
    assert request.num_computed_tokens == 12  # everything but the newest token
    so, _ = step(scheduler, worker)  # the worker checks the KV it reads is right
    assert so.scheduled_cached_reqs.num_computed_tokens == [12]


def test_drafts_are_capped_by_max_tokens_and_max_model_len() -> None:
    scheduler = make_spec_scheduler(block_size=4, max_model_len=64)
    worker = SpecWorker(4)
    short = add(scheduler, "short", 10, max_tokens=3)
    long = add(scheduler, "long", 58, max_tokens=50)
    worker.next_drafts.update({"short": [1, 2, 3, 4], "long": [1, 2, 3, 4]})
    step(scheduler, worker)
    so = scheduler.schedule()
    # short: 1 output, max_tokens 3 -> at most 2 more tokens -> 1 draft.
    # long: 59 tokens, max_model_len 64 -> at most 5 more tokens -> all 4 drafts.
    assert so.scheduled_spec_decode_tokens == {"short": [1], "long": [1, 2, 3, 4]}
    assert short.num_computed_tokens == 12 and long.num_computed_tokens == 63
    scheduler.update_from_output(so, worker.execute(so))


def test_a_request_past_max_model_len_never_gets_drafts() -> None:
    scheduler = make_spec_scheduler(block_size=4, max_model_len=61)
    worker = SpecWorker(4)
    add(scheduler, "a", 59, max_tokens=50)
    worker.next_drafts["a"] = [1, 2]
    step(scheduler, worker)  # 60 tokens: one more may come, with no draft
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"a": 1}


def test_the_token_budget_cuts_drafts() -> None:
    scheduler = make_spec_scheduler(block_size=4, max_num_batched_tokens=7)
    worker = SpecWorker(4)
    add(scheduler, "a", 3, max_tokens=50)
    add(scheduler, "b", 3, max_tokens=50)
    worker.next_drafts.update({"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]})
    step(scheduler, worker)
    so = scheduler.schedule()
    # a takes 1 + 4 tokens, b gets the 2 left: its token and one draft.
    assert so.num_scheduled_tokens == {"a": 5, "b": 2}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3, 4], "b": [5]}
    scheduler.update_from_output(so, worker.execute(so))


def test_preemption_drops_the_drafts() -> None:
    scheduler = make_spec_scheduler(num_blocks=6, block_size=4)
    worker = SpecWorker(4)
    first = add(scheduler, "a", 8, max_tokens=50)
    second = add(scheduler, "b", 8, max_tokens=50)
    worker.next_drafts.update({"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]})
    step(scheduler, worker)  # 4 of the 5 usable blocks in use
    so = scheduler.schedule()  # a needs a 5th and 6th block for its drafts: b is preempted
    assert so.preempted_req_ids == ["b"] and second.spec_token_ids == []
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3, 4]}
    scheduler.update_from_output(so, worker.execute(so))
    assert first.num_computed_tokens == first.num_tokens - 1


# ----------------------------------------------------------- stop conditions


@pytest.mark.parametrize(
    "kwargs, stop_at, reason",
    [
        ({}, EOS, "stop"),  # EOS inside the accepted run
        ({"stop_token_ids": [42]}, 42, "stop"),
    ],
)
def test_a_stop_token_inside_the_accepted_run_ends_it_there(kwargs, stop_at, reason) -> None:
    scheduler = make_spec_scheduler(block_size=4)
    worker = SpecWorker(4, accept=4)
    request = add(scheduler, "a", 6, max_tokens=50, **kwargs)
    worker.next_drafts["a"] = [11, stop_at, 13, 14]
    step(scheduler, worker)
    first = list(request.output_token_ids)
    _, outputs = step(scheduler, worker)
    assert outputs[0].new_token_ids == [11, stop_at]  # 13, 14 and the bonus are dropped
    assert str(outputs[0].finish_reason) == reason
    assert request.output_token_ids == first + [11, stop_at]
    assert scheduler.kv_cache_manager.all_blocks_free()


def test_max_tokens_inside_the_accepted_run_ends_it_there() -> None:
    scheduler = make_spec_scheduler(block_size=4)
    worker = SpecWorker(4, model=lambda tokens: 13, accept=4)
    add(scheduler, "a", 6, max_tokens=4)
    worker.next_drafts["a"] = [11, 12, 13, 14]
    step(scheduler, worker)
    worker.next_drafts["a"] = [11, 12, 13, 14]
    so, outputs = step(scheduler, worker)
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12]}  # capped: 3 tokens may come
    assert outputs[0].new_token_ids == [11, 12, 13]
    assert str(outputs[0].finish_reason) == "length"
    assert scheduler.kv_cache_manager.all_blocks_free()


def test_min_tokens_holds_inside_the_run() -> None:
    # An EOS draft accepted before min_tokens does not end the request.
    scheduler = make_spec_scheduler(block_size=4)
    worker = SpecWorker(4, model=lambda tokens: 13, accept=2)
    request = add(scheduler, "a", 6, max_tokens=50, min_tokens=5)
    worker.next_drafts["a"] = [EOS, 12]
    step(scheduler, worker)
    _, outputs = step(scheduler, worker)
    assert outputs[0].new_token_ids == [EOS, 12, 13] and not request.is_finished


# --------------------------------------------------------------- whole runs


def test_stats_count_drafts_and_acceptance_per_position() -> None:
    scheduler = make_spec_scheduler(block_size=4)
    worker = SpecWorker(4, accept=2)
    add(scheduler, "a", 6, max_tokens=50)
    worker.next_drafts["a"] = [1, 2, 3]
    step(scheduler, worker)
    scheduler.make_stats()
    step(scheduler, worker)
    stats = scheduler.make_stats()
    assert (
        stats.spec_decode_num_drafts,
        stats.spec_decode_num_draft_tokens,
        stats.spec_decode_num_accepted_tokens,
    ) == (1, 3, 2)
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 1, 0, 0]
    assert scheduler.make_stats().spec_decode_num_drafts == 0  # deltas


def _prompts(rng: random.Random) -> list[list[int]]:
    shared = [rng.randrange(100, 200) for _ in range(20)]
    prompts = []
    for i in range(8):
        body = [rng.randrange(100, 200) for _ in range(rng.randrange(1, 30))]
        if i % 3 == 0:
            body = (body[:5] * 6)[: len(body) + 10]  # repetitive: drafts right at once
        prompts.append((shared if i % 2 else []) + body)
    return prompts


@pytest.mark.parametrize("seed", range(4))
def test_outputs_equal_those_without_speculation(seed: int) -> None:
    """Chunked prefill (small budget), prefix caching (shared prefixes) and
    preemption (few blocks) all in play; every request's tokens match the
    plain run, and no block leaks."""
    rng = random.Random(seed)
    prompts = _prompts(rng)
    max_tokens = [rng.randrange(1, 60) for _ in prompts]
    results = []
    for k in (0, K):
        scheduler = make_spec_scheduler(
            num_blocks=40, k=k, block_size=4, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=128
        )
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
            add(scheduler, f"r{i}", prompt, max_tokens=n, ignore_eos=True)
        results.append(run_all(scheduler, SpecWorker(4, propose=k > 0)))
    # Speculation did happen, and was sometimes right and sometimes wrong.
    totals = scheduler.spec_decode
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    plain, spec = results
    assert spec == plain
    assert all(len(plain[f"r{i}"]) == n for i, n in enumerate(max_tokens))
