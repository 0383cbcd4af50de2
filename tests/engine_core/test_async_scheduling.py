"""Async scheduling (``--async-scheduling``) against the plain engine loop, model-free.

The real ``EngineCore`` runs its steps on its forward thread, driving a
``FakeWorker`` (which checks every step's KV contents and, like the real
worker, feeds the token it sampled as the next step's input). Whatever the
workload, the token streams must be the ones the synchronous loop gives.
"""

from __future__ import annotations

import argparse
import threading
import zlib

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocol import (
    EngineConfig,
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    SpeculativeConfig,
)
from protocol.kv_transfer import KVTransferConfig
from services.config.cli_args import add_engine_args, engine_args_from
from services.engine_core.core import EngineCore
from services.engine_core.request import Request
from services.engine_core.structured_output import StructuredOutputManager
from services.worker.executor import Executor
from tests.engine_core.fake_grammar import FakeBackend
from tests.engine_core.fakes import EOS, FakeWorker, make_config, tokens_of
from tests.engine_core.test_structured_output import VOCAB, MaskWorker, compiled, regex

BLOCK = 16


class FakeExecutor(Executor):
    """The executor interface around a FakeWorker; records every step it ran."""

    def __init__(self, config: EngineConfig, worker: FakeWorker) -> None:
        super().__init__(config)
        self.worker = worker
        self.steps: list[SchedulerOutput] = []
        self.num_computed_tokens: dict[str, int] = {}  # per request, over all its steps

    def determine_num_blocks(self) -> int:
        return self.config.cache.num_gpu_blocks_override or 64

    def initialize_cache(self, num_blocks: int) -> None:
        pass  # FakeWorker keeps its "KV" in a dict

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self.num_computed_tokens[request_id] = self.num_computed_tokens.get(request_id, 0) + num_tokens
        return self.worker.execute(scheduler_output)

    def shutdown(self) -> None:
        pass


def make_engine(async_scheduling: bool, worker: FakeWorker | None = None, num_blocks: int = 64, **kwargs):
    kwargs.setdefault("max_model_len", 96)  # fits the smallest cache a test gives
    config = make_config(block_size=BLOCK, async_scheduling=async_scheduling, **kwargs)
    config = msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(config.model, vocab_size=VOCAB),
        cache=msgspec.structs.replace(config.cache, num_gpu_blocks_override=num_blocks),
    )
    worker = worker or FakeWorker(BLOCK)
    return EngineCore(config, executor_class=lambda c: FakeExecutor(c, worker))


def add(engine: EngineCore, request_id: str, prompt: list[int] | int, **sampling_kwargs) -> Request:
    if isinstance(prompt, int):
        start = 100 + zlib.crc32(request_id.encode()) % 1000 * 100  # unique to the id: no shared prefix
        prompt = list(range(start, start + prompt))
    sampling_kwargs.setdefault("max_tokens", 8)
    request = Request(
        request_id,
        prompt,
        SamplingParams(**sampling_kwargs),
        arrival_time=0.0,
        eos_token_id=EOS,
        block_hasher=engine.scheduler.block_hasher,
    )
    engine.scheduler.add_request(request)
    return request


def run(engine: EngineCore, aborts: dict[int, list[str]] | None = None, max_steps: int = 3000):
    """Step until nothing is left; ``aborts``: step index -> ids aborted before it. {id: [outputs]}."""
    by_request: dict[str, list] = {}
    try:
        for index in range(max_steps):
            if aborts and index in aborts:
                engine.abort_requests(aborts[index])
            if not engine.has_unfinished_requests() and (not aborts or index > max(aborts)):
                break
            for output in engine.step().outputs:
                by_request.setdefault(output.request_id, []).append(output)
        assert not engine.has_unfinished_requests(), "requests did not finish"
        assert engine.scheduler.kv_cache_manager.all_blocks_free()
    finally:
        engine.shutdown()
    return by_request


def finishes(outputs) -> list[FinishReason]:
    return [o.finish_reason for o in outputs if o.finished]


def test_streams_match_the_synchronous_loop_for_mixed_lengths_and_stops():
    def workload(engine):
        add(engine, "short", 3, max_tokens=2)
        add(engine, "long", 40, max_tokens=12)
        add(engine, "eos", 7, max_tokens=20)
        add(engine, "stop-id", 9, max_tokens=20, stop_token_ids=[1004])
        add(engine, "min", 5, max_tokens=6, min_tokens=6, stop_token_ids=[1001])
        return run(engine)

    def next_token(request_id: str, index: int) -> int:
        return EOS if request_id == "eos" and index == 5 else 1000 + index

    sync = workload(make_engine(False, FakeWorker(BLOCK, next_token)))
    ahead = workload(make_engine(True, FakeWorker(BLOCK, next_token)))
    assert {r: tokens_of(o) for r, o in ahead.items()} == {r: tokens_of(o) for r, o in sync.items()}
    assert {r: finishes(o) for r, o in ahead.items()} == {r: finishes(o) for r, o in sync.items()}
    assert tokens_of(ahead["eos"]) == [1000, 1001, 1002, 1003, 1004, EOS]
    assert tokens_of(ahead["stop-id"])[-1] == 1004 and ahead["stop-id"][-1].stop_reason == 1004


def test_the_token_computed_past_a_stop_is_dropped_not_emitted():
    worker = FakeWorker(BLOCK, lambda request_id, index: EOS if index == 3 else 1000 + index)
    engine = make_engine(True, worker)
    executor = engine.executor
    add(engine, "r", 5, max_tokens=50)
    outputs = run(engine)["r"]
    assert tokens_of(outputs) == [1000, 1001, 1002, EOS]
    assert finishes(outputs) == [FinishReason.STOP]
    # The step after the stop was already scheduled when the stop was seen: it fed
    # the stop token back in (5 prompt + 3 decode inputs + 1), and its token was dropped.
    assert executor.num_computed_tokens["r"] == 5 + 3 + 1


def test_steps_overlap_one_placeholder_ahead():
    engine = make_engine(True)
    add(engine, "r", 4, max_tokens=5)
    request = engine.scheduler.requests["r"]
    first = engine.step()  # the prefill and the first decode were handed out before any token was back
    assert tokens_of(first.outputs) == [1000]
    assert len(engine.pipeline) == 1  # the decode still runs: its token is a placeholder
    assert request.num_output_placeholders == 1 and request.num_output_tokens == 1
    outputs = run(engine)
    assert tokens_of(outputs["r"]) == [1001, 1002, 1003, 1004]
    assert [dict(s.num_scheduled_tokens) for s in engine.executor.steps] == [{"r": 4}] + [{"r": 1}] * 4


def test_a_request_is_not_scheduled_past_its_max_tokens():
    engine = make_engine(True)
    executor = engine.executor
    add(engine, "r", 6, max_tokens=4)
    outputs = run(engine)["r"]
    assert tokens_of(outputs) == [1000, 1001, 1002, 1003]
    assert finishes(outputs) == [FinishReason.LENGTH]
    # The length cap is known ahead: no step computes a token that would be thrown away.
    assert executor.num_computed_tokens["r"] == 6 + 3


def test_the_model_length_caps_ahead_as_well():
    engine = make_engine(True, max_model_len=40)
    add(engine, "r", 36, max_tokens=100)
    outputs = run(engine)["r"]
    assert tokens_of(outputs) == [1000, 1001, 1002, 1003]
    assert engine.executor.num_computed_tokens["r"] == 39  # position 39 would hold a 41st token


def test_preemption_under_a_small_cache_keeps_the_streams():
    def workload(engine):
        for name in "abc":
            add(engine, name, 20, max_tokens=30)
        return run(engine)

    sync_engine, async_engine = make_engine(False, num_blocks=7), make_engine(True, num_blocks=7)
    sync = workload(sync_engine)
    ahead = workload(async_engine)
    preempted = sum(len(s.preempted_req_ids) for s in async_engine.executor.steps)
    assert preempted > 0
    assert {r: tokens_of(o) for r, o in ahead.items()} == {r: tokens_of(o) for r, o in sync.items()}
    assert all(tokens_of(o) == [1000 + k for k in range(30)] for o in ahead.values())


def test_a_request_preempted_while_its_last_token_runs_finishes_from_the_queue():
    def workload(engine):
        add(engine, "a", 14, max_tokens=30)
        add(engine, "b", 15, max_tokens=3)
        return run(engine)

    sync = workload(make_engine(False, num_blocks=4, max_model_len=48))
    engine = make_engine(True, num_blocks=4, max_model_len=48)  # 3 usable blocks
    ahead = workload(engine)
    assert {r: tokens_of(o) for r, o in ahead.items()} == {r: tokens_of(o) for r, o in sync.items()}
    assert tokens_of(ahead["b"]) == [1000, 1001, 1002] and finishes(ahead["b"]) == [FinishReason.LENGTH]
    steps = engine.executor.steps
    preempted_at = next(i for i, so in enumerate(steps) if "b" in so.preempted_req_ids)
    # "a" needed b's block while b's last token was in flight; b ended in the queue, never re-admitted.
    assert not any(new.req_id == "b" for so in steps[preempted_at:] for new in so.scheduled_new_reqs)
    assert not engine.scheduler.waiting


def test_chunked_prefill_with_prompt_logprobs_reports_each_position_once():
    def workload(engine):
        add(engine, "r", 50, max_tokens=3, prompt_logprobs=0, logprobs=0)
        return run(engine)["r"]

    sync = workload(make_engine(False, max_num_batched_tokens=16))
    ahead = workload(make_engine(True, max_num_batched_tokens=16))
    positions = [p for o in ahead for p in (o.new_prompt_logprobs or [])]
    assert len(positions) == 50
    assert positions == [p for o in sync for p in (o.new_prompt_logprobs or [])]
    assert tokens_of(ahead) == tokens_of(sync) == [1000, 1001, 1002]


def test_an_abort_mid_run_is_applied_a_step_late_and_frees_everything():
    engine = make_engine(True)
    add(engine, "gone", 5, max_tokens=40)
    add(engine, "stays", 5, max_tokens=10)
    outputs = run(engine, aborts={4: ["gone"]})
    gone = tokens_of(outputs["gone"])
    assert gone == [1000 + k for k in range(len(gone))] and 0 < len(gone) < 40
    assert not finishes(outputs["gone"])
    assert tokens_of(outputs["stays"]) == [1000 + k for k in range(10)]


def test_a_reused_request_id_never_takes_the_aborted_requests_token():
    engine = make_engine(True)
    add(engine, "r", 5, max_tokens=40)
    engine.step()
    engine.step()
    engine.abort_requests(["r"])  # a step with "r" is in flight
    add(engine, "r", 7, max_tokens=3)
    outputs = run(engine)
    assert tokens_of(outputs["r"])[-3:] == [1000, 1001, 1002]
    assert finishes(outputs["r"]) == [FinishReason.LENGTH]


def test_a_constrained_request_waits_for_its_token_while_others_run_ahead():
    worker = MaskWorker(BLOCK)
    engine = make_engine(True, worker)
    config = engine.config
    engine.scheduler.structured_output_manager = StructuredOutputManager(
        config, backend_factory=lambda: FakeBackend(VOCAB, EOS)
    )
    constrained = add(engine, "c", 5, structured_outputs=regex("7 8 9"), max_tokens=16)
    compiled(constrained)
    add(engine, "p", 5, max_tokens=6)
    outputs = run(engine)
    assert tokens_of(outputs["c"]) == [7, 8, 9, EOS]
    assert finishes(outputs["c"]) == [FinishReason.STOP]
    assert tokens_of(outputs["p"]) == [1000 + k for k in range(6)]
    # Its masks were built from a known grammar state: it never had a step scheduled ahead.
    assert engine.executor.num_computed_tokens["c"] == 5 + 3


def test_steps_run_on_the_forward_thread_and_shutdown_joins_it():
    names = []

    class Recording(FakeWorker):
        def execute(self, so):
            names.append(threading.current_thread().name)
            return super().execute(so)

    engine = make_engine(True, Recording(BLOCK))
    add(engine, "r", 4, max_tokens=3)
    run(engine)
    assert names and all(name.startswith("engine-forward") for name in names)
    with pytest.raises(RuntimeError, match="shutdown"):  # the forward thread is gone
        engine.pipeline.submit(engine.executor.steps[0], {})


request_spec = st.fixed_dictionaries(
    {
        "shared": st.integers(0, 40),
        "own": st.integers(1, 12),
        "max_tokens": st.integers(1, 20),
        "eos_at": st.one_of(st.none(), st.integers(0, 20)),
        "abort_at": st.one_of(st.none(), st.integers(0, 25)),
    }
)
config_spec = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(96 // BLOCK + 1, 14),
        "max_num_batched_tokens": st.integers(8, 96),
        "max_num_seqs": st.integers(1, 5),
        "long_prefill_token_threshold": st.sampled_from([0, 8]),
        "caching": st.booleans(),
        "scheduling_policy": st.sampled_from(["fcfs", "priority", "shortest-first"]),
    }
)


def _spec(own: int, max_tokens: int, shared: int = 0) -> dict:
    return {"shared": shared, "own": own, "max_tokens": max_tokens, "eos_at": None, "abort_at": None}


@settings(max_examples=150, deadline=None)
@given(config=config_spec, specs=st.lists(request_spec, min_size=1, max_size=6))
# A step that only preempts (no tokens) must still reach the worker, in both loops.
@example(
    config={
        "num_blocks": 7,
        "max_num_batched_tokens": 26,
        "max_num_seqs": 3,
        "long_prefill_token_threshold": 0,
        "caching": False,
        "scheduling_policy": "priority",
    },
    specs=[_spec(1, 1), _spec(1, 1), _spec(1, 3), _spec(4, 14), _spec(12, 14, shared=9), _spec(7, 12)],
)
def test_random_workloads_give_the_synchronous_streams(config, specs):
    num_blocks = config.pop("num_blocks")

    def next_token(request_id: str, index: int) -> int:
        eos_at = specs[int(request_id[1:])]["eos_at"]
        return EOS if index == eos_at else 1000 + index

    def workload(async_scheduling: bool):
        engine = make_engine(
            async_scheduling, FakeWorker(BLOCK, next_token), num_blocks, max_model_len=96, **config
        )
        for i, spec in enumerate(specs):
            prompt = [7 + j for j in range(spec["shared"])] + [5000 + 100 * i + j for j in range(spec["own"])]
            add(engine, f"r{i}", prompt, max_tokens=spec["max_tokens"])
        aborts: dict[int, list[str]] = {}
        for i, spec in enumerate(specs):
            if spec["abort_at"] is not None:
                aborts.setdefault(spec["abort_at"], []).append(f"r{i}")
        return run(engine, aborts)

    sync, ahead = workload(False), workload(True)
    for i, spec in enumerate(specs):
        rid = f"r{i}"
        got, want = ahead.get(rid, []), sync.get(rid, [])
        if spec["abort_at"] is None:
            assert tokens_of(got) == tokens_of(want)
            assert finishes(got) == finishes(want)
        else:  # the abort lands a step later in the stream: any prefix of the same tokens
            tokens = tokens_of(got)
            full = [EOS if k == spec["eos_at"] else 1000 + k for k in range(len(tokens))]
            assert tokens == full
            assert len(finishes(got)) <= 1


# ------------------------------------------------------------------ config


def test_the_flag_round_trips_through_the_cli_and_the_wire():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).async_scheduling is False
    args = engine_args_from(parser.parse_args(["--async-scheduling"]))
    assert args.async_scheduling is True
    config = make_config(async_scheduling=True)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert decoded.scheduler.async_scheduling is True
    assert make_config().scheduler.async_scheduling is False


def test_the_real_model_config_carries_the_flag():
    from services.config.engine_args import EngineArgs

    assert EngineArgs(async_scheduling=True).create_engine_config().scheduler.async_scheduling is True
    assert EngineArgs().create_engine_config().scheduler.async_scheduling is False


def test_speculative_decoding_is_refused_with_a_clear_error():
    from services.config.engine_args import EngineArgs

    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match="async_scheduling does not support speculative decoding"):
        EngineArgs(async_scheduling=True, speculative_config=ngram).create_engine_config()
    config = msgspec.structs.replace(
        make_config(async_scheduling=True),
        speculative=SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2
        ),
    )
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineCore(config, executor_class=lambda c: FakeExecutor(c, FakeWorker(BLOCK)))


def test_disaggregated_prefill_is_refused_with_a_clear_error():
    config = msgspec.structs.replace(
        make_config(async_scheduling=True),
        kv_transfer=KVTransferConfig(kv_connector="ZmqConnector", kv_role="kv_consumer"),
    )
    with pytest.raises(ValueError, match="async_scheduling does not support disaggregated prefill/decode"):
        EngineCore(config, executor_class=lambda c: FakeExecutor(c, FakeWorker(BLOCK)))
