"""Async scheduling (vLLM's ``--async-scheduling``): schedule step N+1 while step N runs.

The executor's ``execute_model`` runs on one background thread (torch ops
release the GIL), fed in order from a queue at most two steps deep, while the
engine's thread schedules the next step and turns the previous step's output
into ``EngineCoreOutput``s. So scheduling, output processing and the grammar
mask fill leave the forward's critical path.

A request that samples in step N is scheduled for step N+1 before its token
is known: the scheduler counts an output placeholder for it
(``Request.num_output_placeholders``), and the worker, which runs the steps in
order, feeds the token it sampled in N as N+1's input. Stops and aborts are
therefore applied one step late; the token a request computed past its stop
is dropped with its step's output (the request is gone by then), never
emitted. A request with structured outputs is not scheduled ahead: its next
grammar mask depends on the token still in flight, so it waits for it.

Speculative decoding (the drafts of step N+1 come from the tokens step N
accepts) and disaggregated prefill/decode (KV transfers finish between steps)
are refused at start-up (``services/config/async_scheduling_args.py``).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from protocol import ModelRunnerOutput, SchedulerOutput
from services.engine_core.request import Request

if TYPE_CHECKING:
    from services.worker.executor import Executor

# Steps in flight: the one running and the one scheduled behind it.
PIPELINE_DEPTH = 2


class ScheduledStep:
    """A step handed to the executor: what was scheduled, for whom, and its result to come."""

    def __init__(
        self,
        scheduler_output: SchedulerOutput,
        requests: dict[str, Request],
        result: Future[ModelRunnerOutput],
    ):
        self.scheduler_output = scheduler_output
        # The Request objects scheduled, so an output is never applied to a
        # later request that reused a finished one's id.
        self.requests = requests
        self.result = result


class StepPipeline:
    """Runs the executor's steps in order on one thread; the engine collects them oldest first."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-forward")
        self._in_flight: deque[ScheduledStep] = deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    @property
    def full(self) -> bool:
        return len(self._in_flight) >= PIPELINE_DEPTH

    def submit(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        result = self._thread.submit(self._executor.execute_model, scheduler_output)
        self._in_flight.append(ScheduledStep(scheduler_output, requests, result))

    def pop_oldest(self) -> tuple[ScheduledStep, ModelRunnerOutput]:
        """Wait for the oldest step; its executor error, if any, is raised here."""
        step = self._in_flight.popleft()
        return step, step.result.result()

    def shutdown(self) -> None:
        """Wait for the running step (the workers must not be torn down under it); drop the queued one."""
        self._in_flight.clear()
        self._thread.shutdown(wait=True, cancel_futures=True)


def reaches_workers(scheduler_output: SchedulerOutput) -> bool:
    """A step the workers must see: tokens to run, or requests to drop."""
    return bool(
        scheduler_output.total_num_scheduled_tokens
        or scheduler_output.finished_req_ids
        or scheduler_output.preempted_req_ids
    )
