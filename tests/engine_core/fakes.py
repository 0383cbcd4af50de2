"""Helpers for scheduler tests: configs, requests, and a worker stand-in.

``FakeWorker`` rebuilds each request's state from the SchedulerOutputs
alone, as the real worker does, and asserts the stream is consistent
(block tables cover every computed token, cached diffs line up), so every
scenario also checks the scheduler -> worker contract.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    TokenLogprobs,
)
from services.engine_core.request import Request
from services.engine_core.scheduler import Scheduler

EOS = 2
_arrivals = itertools.count()
_prompt_starts = itertools.count(10_000, 10_000)


def make_config(
    *,
    max_model_len: int = 1024,
    block_size: int = 16,
    caching: bool = True,
    **scheduler_kwargs,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model="fake.gguf",
            tokenizer="fake",
            served_model_name="fake",
            dtype="float32",
            max_model_len=max_model_len,
            eos_token_id=EOS,
        ),
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(**scheduler_kwargs),
    )


def make_scheduler(num_blocks: int = 64, **config_kwargs) -> Scheduler:
    return Scheduler(make_config(**config_kwargs), num_blocks)


def make_request(
    scheduler: Scheduler,
    request_id: str,
    prompt: list[int] | int,
    *,
    priority: int = 0,
    cache_salt: str | None = None,
    **sampling_kwargs,
) -> Request:
    """A request built with the scheduler's block hasher.

    ``prompt`` may be a length: then its tokens are unique to this request,
    so no prefix is shared by accident.
    """
    if isinstance(prompt, int):
        start = next(_prompt_starts)
        prompt = list(range(start, start + prompt))
    sampling_kwargs.setdefault("max_tokens", 8)
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**sampling_kwargs),
        arrival_time=time.time(),
        priority=priority,
        eos_token_id=EOS,
        cache_salt=cache_salt,
        block_hasher=scheduler.block_hasher,
    )
    request.arrival_s = float(next(_arrivals))  # the engine's clock, 1 s between arrivals
    return request


def add(scheduler: Scheduler, request_id: str, prompt: list[int] | int, **kwargs) -> Request:
    request = make_request(scheduler, request_id, prompt, **kwargs)
    scheduler.add_request(request)
    return request


@dataclass
class _WorkerRequest:
    tokens: list[int]
    num_prompt: int
    num_computed: int
    params: SamplingParams
    block_ids: list[int] = field(default_factory=list)


def fake_logprob(token_id: int, position: int) -> TokenLogprobs:
    """A recognisable entry: its logprob encodes the position it is for."""
    return TokenLogprobs([token_id], [-float(position)], 1)


class FakeWorker:
    """Samples ``next_token(request_id, output_index)`` once a request's tokens are all computed.

    Emits ``fake_logprob`` entries for requests that ask for logprobs or
    prompt logprobs. Its "KV cache" stores the token id written at each
    slot, and every step checks that the context a request reads (prefix
    hits included) holds that request's own tokens: a wrong block table, a
    bad prefix hit or a block reused while still in use all fail here.
    """

    def __init__(self, block_size: int, next_token: Callable[[str, int], int] | None = None):
        self.block_size = block_size
        self.next_token = next_token or (lambda request_id, index: 1000 + index)
        self.requests: dict[str, _WorkerRequest] = {}
        self.kv: dict[int, int] = {}  # slot -> token id written there

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.requests.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent as new twice"
            self.requests[new.req_id] = _WorkerRequest(
                [*new.prompt_token_ids, *new.output_token_ids],
                len(new.prompt_token_ids),
                new.num_computed_tokens,
                new.sampling_params,
                list(new.block_ids),
            )
        cached = so.scheduled_cached_reqs
        for request_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[request_id]
            assert state.num_computed == num_computed, request_id
            state.block_ids.extend(block_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        out = ModelRunnerOutput()
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.requests[request_id]
            prompt_logprobs = self._prompt_logprobs(state, num_tokens)
            if prompt_logprobs:
                out.prompt_logprobs[request_id] = prompt_logprobs
            sampled = self._run(request_id, num_tokens)
            out.req_ids.append(request_id)
            out.sampled_token_ids.append(sampled)
            wants = state.params.logprobs is not None
            out.logprobs.append([fake_logprob(t, len(state.tokens) - 1) for t in sampled] if wants else [])
        return out

    @staticmethod
    def _prompt_logprobs(state: _WorkerRequest, num_tokens: int):
        if state.params.prompt_logprobs is None:
            return None
        # As the real runner: a chunk scores the token after each of its own, and a
        # prompt's first chunk leads with None for position 0.
        start = state.num_computed
        end = min(start + num_tokens, state.num_prompt - 1)
        first = [None] if start == 0 else []
        return first + [fake_logprob(state.tokens[p], p) for p in range(start + 1, end + 1)]

    def _slot(self, state: _WorkerRequest, position: int) -> int:
        block_id = state.block_ids[position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def _run(self, request_id: str, num_tokens: int) -> list[int]:
        state = self.requests[request_id]
        assert num_tokens > 0
        start, state.num_computed = state.num_computed, state.num_computed + num_tokens
        assert state.num_computed <= len(state.tokens), "scheduled past the known tokens"
        assert len(set(state.block_ids)) == len(state.block_ids), "a block used twice"
        assert 0 not in state.block_ids, "the null block was handed out"
        assert len(state.block_ids) * self.block_size >= state.num_computed, "no slot for a token"
        for position in range(start):
            assert self.kv.get(self._slot(state, position)) == state.tokens[position], (
                f"{request_id}: wrong KV at position {position}"
            )
        for position in range(start, state.num_computed):
            self.kv[self._slot(state, position)] = state.tokens[position]
        if state.num_computed < len(state.tokens):
            return []  # mid-prefill
        token = self.next_token(request_id, len(state.tokens) - state.num_prompt)
        state.tokens.append(token)
        return [token]


def step(scheduler: Scheduler, worker: FakeWorker):
    """One engine step; returns (scheduler_output, engine_core_outputs)."""
    so = scheduler.schedule()
    outputs = scheduler.update_from_output(so, worker.execute(so))
    return so, outputs


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 500):
    """Step until every request finished; returns {request_id: [EngineCoreOutput, ...]}."""
    by_request: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = step(scheduler, worker)
        for output in outputs:
            by_request.setdefault(output.request_id, []).append(output)
    assert not scheduler.has_unfinished_requests(), "requests did not finish"
    assert scheduler.kv_cache_manager.all_blocks_free()
    return by_request


def tokens_of(outputs) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]
