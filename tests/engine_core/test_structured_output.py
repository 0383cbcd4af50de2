"""Structured outputs in the scheduler and its manager, with a fake grammar backend.

Torch-free and fast: grammars are fixed token sequences (tests/engine_core/
fake_grammar.py), compiles are held with an event and timeouts are driven
by a fake clock, so nothing here sleeps.
"""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from protocol import FinishReason, SamplingParams, StructuredOutputsParams
from services.engine_core.request import Request, RequestStatus
from services.engine_core.scheduler import Scheduler
from services.engine_core.structured_output import StructuredOutputManager
from services.model_files import REPO_ROOT
from tests.engine_core.fake_grammar import FakeBackend, lowest_allowed
from tests.engine_core.fakes import EOS, FakeWorker, add, make_config, run_to_completion, step

VOCAB = 4096
TIMEOUT_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class MaskWorker(FakeWorker):
    """A FakeWorker whose constrained requests take the lowest token their mask allows."""

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(block_size, self._next_token)
        self._allowed: dict[str, int] = {}
        self.mask_rows: list[list[str]] = []  # structured_output_request_ids, per step

    def execute(self, so):
        self.mask_rows.append(list(so.structured_output_request_ids))
        rows = [] if so.grammar_bitmask is None else so.grammar_bitmask
        assert len(rows) == len(so.structured_output_request_ids)
        self._allowed = {rid: lowest_allowed(row) for rid, row in zip(so.structured_output_request_ids, rows)}
        return super().execute(so)

    def _next_token(self, request_id: str, index: int) -> int:
        return self._allowed.get(request_id, 1000 + index)


def make_scheduler(num_blocks: int = 64, **config_kwargs) -> tuple[Scheduler, FakeBackend, Clock]:
    config = make_config(**config_kwargs)
    config = msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(config.model, vocab_size=VOCAB),
        structured_outputs=msgspec.structs.replace(config.structured_outputs, compile_timeout=TIMEOUT_S),
    )
    scheduler = Scheduler(config, num_blocks)
    backend, clock = FakeBackend(VOCAB, EOS), Clock()
    scheduler.structured_output_manager = StructuredOutputManager(
        config, backend_factory=lambda: backend, clock=clock
    )
    return scheduler, backend, clock


def regex(spec: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=spec)


def compiled(request: Request) -> None:
    """Block until the request's compile finished (its future, not a sleep)."""
    request.structured_output.job.future.exception(timeout=30)


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_a_constrained_request_waits_for_its_grammar_while_others_run():
    scheduler, backend, _ = make_scheduler()
    worker = MaskWorker()
    backend.release.clear()
    constrained = add(scheduler, "c", 5, structured_outputs=regex("7 8 9"), max_tokens=16)
    add(scheduler, "p", 5, max_tokens=3)
    so, first = step(scheduler, worker)
    assert list(so.num_scheduled_tokens) == ["p"]
    assert constrained.status == RequestStatus.WAITING_FOR_GRAMMAR
    assert scheduler.get_request_counts() == (1, 1)
    assert scheduler.make_stats().num_waiting_reqs == 1
    backend.release.set()
    compiled(constrained)
    outputs = run_to_completion(scheduler, worker)
    assert tokens_of(outputs["c"]) == [7, 8, 9, EOS]
    assert outputs["c"][-1].finish_reason == FinishReason.STOP
    assert tokens_of(first + outputs["p"]) == [1000, 1001, 1002]
    # Masks only for the constrained request, once per step it sampled.
    assert sum(rows == ["c"] for rows in worker.mask_rows) == 4


def test_the_grammar_ending_stops_the_request_even_when_eos_is_ignored():
    scheduler, _, _ = make_scheduler()
    request = add(scheduler, "c", 3, structured_outputs=regex("5 6"), ignore_eos=True, max_tokens=10)
    compiled(request)
    outputs = run_to_completion(scheduler, MaskWorker())
    assert tokens_of(outputs["c"]) == [5, 6, EOS]
    assert outputs["c"][-1].finish_reason == FinishReason.STOP


def test_an_invalid_grammar_fails_only_its_own_request():
    scheduler, _, _ = make_scheduler()
    bad = add(scheduler, "bad", 4, structured_outputs=regex("not token ids"))
    add(scheduler, "ok", 4, max_tokens=2)
    compiled(bad)
    outputs = run_to_completion(scheduler, MaskWorker())
    [failure] = outputs["bad"]
    assert failure.finish_reason == FinishReason.ERROR and failure.new_token_ids == []
    assert "is not a list of token ids" in failure.error
    assert tokens_of(outputs["ok"]) == [1000, 1001]
    assert "bad" not in scheduler.requests


def test_a_compile_past_the_timeout_fails_only_its_own_request():
    scheduler, backend, clock = make_scheduler()
    worker = MaskWorker()
    backend.release.clear()
    try:
        slow = add(scheduler, "slow", 4, structured_outputs=regex("7"))
        add(scheduler, "ok", 4, max_tokens=3)
        assert backend.started.wait(30)
        _, outputs = step(scheduler, worker)
        assert slow.status == RequestStatus.WAITING_FOR_GRAMMAR
        assert [o.request_id for o in outputs] == ["ok"]
        clock.now += TIMEOUT_S + 0.1
        _, outputs = step(scheduler, worker)
        [failure] = [o for o in outputs if o.request_id == "slow"]
        assert failure.finish_reason == FinishReason.ERROR
        assert "longer than 2s" in failure.error and "--structured-outputs-compile-timeout" in failure.error
        rest = run_to_completion(scheduler, worker)
        assert tokens_of(rest["ok"])[-1] == 1002
    finally:
        backend.release.set()


def test_an_abort_while_compiling_leaves_nothing_behind():
    scheduler, backend, _ = make_scheduler()
    backend.release.clear()
    try:
        add(scheduler, "c", 4, structured_outputs=regex("7"))
        scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
        _, outputs = step(scheduler, MaskWorker())
        assert outputs == [] and not scheduler.has_unfinished_requests()
        assert scheduler.get_request_counts() == (0, 0)
    finally:
        backend.release.set()


def test_one_compile_per_constraint_and_failures_are_not_cached():
    scheduler, backend, _ = make_scheduler()
    first = add(scheduler, "a", 4, structured_outputs=regex("7 8"))
    second = add(scheduler, "b", 4, structured_outputs=regex("7 8"))
    compiled(first)
    compiled(second)
    run_to_completion(scheduler, MaskWorker())
    assert backend.compiled == ["7 8"]
    for name in ("x", "y"):
        compiled(add(scheduler, name, 4, structured_outputs=regex("oops")))
        run_to_completion(scheduler, MaskWorker())
    assert backend.compiled == ["7 8", "oops", "oops"]
    stats = scheduler.make_stats().structured_outputs
    assert stats.num_requests == 4 and sum(stats.compile_counts) == 1  # only successes are timed


def test_only_requests_that_sample_get_a_mask_row():
    scheduler, _, _ = make_scheduler(max_num_batched_tokens=16)
    request = add(scheduler, "c", 40, structured_outputs=regex("7"), max_tokens=4)
    compiled(request)
    worker = MaskWorker()
    outputs = run_to_completion(scheduler, worker)
    # 40 prompt tokens in chunks of 16, 16 and 8: the last one samples.
    assert worker.mask_rows == [[], [], ["c"], ["c"]]
    assert tokens_of(outputs["c"]) == [7, EOS]


def test_a_token_outside_the_mask_fails_the_request():
    scheduler, _, _ = make_scheduler()
    request = add(scheduler, "c", 4, structured_outputs=regex("7 8"))
    compiled(request)
    outputs = run_to_completion(scheduler, FakeWorker(16))  # ignores masks: samples 1000
    [only] = outputs["c"]
    assert only.finish_reason == FinishReason.ERROR and "refused token 1000" in only.error


def ready_request(manager: StructuredOutputManager, spec: str) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(structured_outputs=regex(spec)), 0.0, eos_token_id=EOS)
    manager.add_request(request)
    compiled(request)
    ready, failed, pending = manager.split_compiled([request])
    assert ready == [request] and not failed and not pending
    return request


def test_drafts_are_cut_to_what_the_grammar_accepts_and_get_a_row_each():
    scheduler, _, _ = make_scheduler()
    manager = scheduler.structured_output_manager
    request = ready_request(manager, "7 8 9")
    request.spec_token_ids = [7, 8, 99, 9]
    manager.filter_drafts([request])
    assert request.spec_token_ids == [7, 8]
    ids, bitmask = manager.grammar_bitmask([request], {"r": 3 + 2}, {"r": [7, 8]})
    assert ids == ["r"] and bitmask.shape == (3, VOCAB // 32) and bitmask.dtype == np.int32
    assert [lowest_allowed(row) for row in bitmask] == [7, 8, 9]
    # Filling walked the drafts and back: the grammar still expects 7.
    assert [lowest_allowed(row) for row in manager.grammar_bitmask([request], {"r": 3}, {})[1]] == [7]


def test_masks_of_a_batch_follow_the_scheduled_order():
    scheduler, _, _ = make_scheduler()
    manager = scheduler.structured_output_manager
    first, second = ready_request(manager, "7"), ready_request(manager, "11 12")
    second.request_id = "r2"
    plain = Request("p", [1], SamplingParams(), 0.0)
    ids, bitmask = manager.grammar_bitmask([second, plain, first], {"r2": 3, "p": 1, "r": 3}, {})
    assert ids == ["r2", "r"] and [lowest_allowed(row) for row in bitmask] == [11, 7]
    assert manager.grammar_bitmask([plain], {"p": 1}, {}) == ([], None)


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_the_compile_timeout_must_be_positive(timeout):
    from protocol import StructuredOutputsConfig

    with pytest.raises(ValueError, match="structured_outputs_compile_timeout must be positive"):
        StructuredOutputsConfig(compile_timeout=timeout)


def test_a_refused_token_is_the_engines_fault_and_a_bad_grammar_the_clients():
    scheduler, _, _ = make_scheduler()
    compiled(add(scheduler, "refused", 4, structured_outputs=regex("7 8")))
    compiled(add(scheduler, "bad", 4, structured_outputs=regex("not token ids")))
    outputs = run_to_completion(scheduler, FakeWorker(16))  # ignores masks: samples 1000
    assert outputs["refused"][-1].error_is_internal
    assert outputs["bad"][-1].finish_reason == FinishReason.ERROR and not outputs["bad"][-1].error_is_internal


def test_a_compiled_request_goes_ahead_of_later_arrivals():
    scheduler, backend, _ = make_scheduler(max_num_seqs=1)
    worker = MaskWorker()
    add(scheduler, "running", 4, max_tokens=50)
    step(scheduler, worker)
    backend.release.clear()
    constrained = add(scheduler, "c", 4, structured_outputs=regex("7 8"))
    add(scheduler, "late", 4)
    step(scheduler, worker)
    backend.release.set()
    compiled(constrained)
    step(scheduler, worker)
    assert [r.request_id for r in scheduler.waiting] == ["c", "late"]


def test_a_compile_still_queued_times_out_and_never_runs():
    """Slow constraints fill every compile thread; one queued behind them
    fails once its timeout (from submission) passes, though it never started."""
    from services.engine_core.structured_output.manager import _COMPILE_THREADS

    scheduler, backend, clock = make_scheduler()
    worker = MaskWorker()
    backend.release.clear()
    try:
        for i in range(_COMPILE_THREADS):
            add(scheduler, f"slow{i}", 4, structured_outputs=regex(f"{i}"))
        queued = add(scheduler, "queued", 4, structured_outputs=regex("7 8"))
        assert backend.started.wait(30)
        step(scheduler, worker)
        assert queued.structured_output.job.started_at is None  # waiting for a thread
        clock.now += TIMEOUT_S + 0.1
        _, outputs = step(scheduler, worker)
        failed = {o.request_id: o for o in outputs if o.finish_reason == FinishReason.ERROR}
        assert "queued" in failed and "longer than 2s" in failed["queued"].error
        assert queued.structured_output.job.future.cancelled()  # it will never take a thread
    finally:
        backend.release.set()
    assert "7 8" not in backend.compiled


def test_compiles_in_flight_are_bounded():
    scheduler, backend, _ = make_scheduler()
    manager = scheduler.structured_output_manager
    manager.max_compiles_in_flight = 2
    backend.release.clear()
    try:
        first = add(scheduler, "a", 4, structured_outputs=regex("1"))
        add(scheduler, "b", 4, structured_outputs=regex("2"))
        shared = add(scheduler, "a2", 4, structured_outputs=regex("1"))  # shares a's compile: no new one
        over = add(scheduler, "c", 4, structured_outputs=regex("3"))
        assert shared.structured_output.job is first.structured_output.job
        _, failed, _ = manager.split_compiled([over])
        assert [r.request_id for r, _ in failed] == ["c"] and "compiling already" in failed[0][1]
    finally:
        backend.release.set()
    compiled(first)
    _, failed, _ = manager.split_compiled([add(scheduler, "d", 4, structured_outputs=regex("4"))])
    assert failed == []  # room again once compiles end


_STUCK_COMPILE_SCRIPT = """
import threading

import os

import msgspec

from protocol import SamplingParams, StructuredOutputsParams
from services.engine_core.scheduler import Scheduler
from services.engine_core.structured_output import StructuredOutputManager
from services.model_files import REPO_ROOT
from tests.engine_core.fake_grammar import FakeBackend
from tests.engine_core.fakes import EOS, add, make_config


class StuckBackend(FakeBackend):
    def compile(self, params):
        self.started.set()
        threading.Event().wait()  # never ends (the grammar that compiles for ever)


config = make_config()
config = msgspec.structs.replace(
    config, structured_outputs=msgspec.structs.replace(config.structured_outputs, compile_timeout=0.01)
)
scheduler = Scheduler(config, 64)
backend = StuckBackend(4096, EOS)
scheduler.structured_output_manager = StructuredOutputManager(config, backend_factory=lambda: backend)
add(scheduler, "stuck", 8, structured_outputs=StructuredOutputsParams(regex="1 2"))
assert backend.started.wait(30)
while not scheduler.schedule().finished_req_ids:  # the compile times out: the request fails
    pass
scheduler.structured_output_manager.shutdown()
print("stopped", flush=True)
"""


def test_a_compile_that_never_ends_does_not_keep_the_process_from_exiting(tmp_path):
    """Before: the compile's pool thread was joined at exit, so an engine whose compile
    timed out ignored its stop until SIGKILLed. Now the process exits once stopped."""
    import subprocess
    import sys

    script = tmp_path / "stuck_compile.py"
    script.write_text(_STUCK_COMPILE_SCRIPT)
    try:  # run() kills it at the deadline
        result = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},  # it imports tests.engine_core
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process waits for a compile that never ends")
    assert result.returncode == 0 and result.stdout.strip() == "stopped", result.stderr
