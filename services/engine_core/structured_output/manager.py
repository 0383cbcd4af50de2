"""StructuredOutputManager: request grammars for the scheduler.

It compiles each constrained request's grammar on a thread pool, so the
engine loop never waits for a compile: the request sits in
WAITING_FOR_GRAMMAR and the scheduler asks ``split_compiled`` each step
which ones are ready. Compiled grammars are cached by constraint, and a
compile in flight is shared by every request that asks for the same one.

Each step it fills the token masks of the constrained requests that sample
(``grammar_bitmask``), and after the step it advances each request's
grammar over its new tokens (``accept_token``).

The backend (xgrammar, which imports torch) is created on the first
constrained request, on a pool thread: engines that never see one never
load it, and the scheduler's tests stay torch-free.

Slow constraints cannot starve the others: a compile's timeout counts from
its submission (time queued behind other compiles included; only the
backend's one-time start-up is not counted), a compile that timed out while
still queued never runs, and at most ``MAX_COMPILES_IN_FLIGHT`` distinct
compiles are queued or running at once -- a request with a new constraint
past that fails at once with a clear error instead of joining the queue.

Compiles run on daemon threads (``_DaemonPool``), not a ThreadPoolExecutor,
whose threads the interpreter joins at exit: a compile stuck past its timeout
is abandoned when the engine stops, which then exits within its shutdown
timeout instead of waiting for the compile (and being SIGKILLed). Until the
engine stops, such a compile keeps its thread and a CPU (xgrammar has no
cancellation); it counts against ``MAX_COMPILES_IN_FLIGHT`` until it ends.
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from protocol import EngineConfig, StructuredOutputsParams
from protocol.structured_outputs import COMPILE_TIME_BUCKETS, StructuredOutputStats
from services.engine_core.request import Request, RequestStatus
from services.engine_core.structured_output.backend import (
    StructuredOutputBackend,
    bitmask_words,
)
from services.engine_core.structured_output.request_state import CompileJob, StructuredOutputRequest

# Compiled grammars kept for reuse; the least recently asked for goes first.
MAX_CACHED_GRAMMARS = 256
# Half the cores, as vLLM does, but at least two: a compile that runs past
# its timeout keeps its thread until it ends, and must not stall the others.
_COMPILE_THREADS = max(2, (os.cpu_count() or 2) // 2)
# Distinct compiles queued or running (ones past their timeout count until they end).
MAX_COMPILES_IN_FLIGHT = 4 * _COMPILE_THREADS


@dataclass
class _Totals:
    """Running totals since the engine started (reported whole, never as deltas)."""

    num_requests: int = 0
    compile_counts: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_TIME_BUCKETS) + 1))
    compile_seconds: float = 0.0
    # Engine-side mask cost, for benchmarks: seconds filling masks, the steps
    # that did and the rows they filled.
    fill_seconds: float = 0.0
    num_fill_steps: int = 0
    num_fill_rows: int = 0


class StructuredOutputManager:
    def __init__(
        self,
        config: EngineConfig,
        backend_factory: Callable[[], StructuredOutputBackend] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.compile_timeout = config.structured_outputs.compile_timeout
        self.vocab_size = config.model.vocab_size
        self._backend_factory = backend_factory or (lambda: _xgrammar_backend(config))
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._clock = clock
        self._executor: _DaemonPool | None = None
        self._cache: OrderedDict[tuple[str, str, bool], CompileJob] = OrderedDict()
        self._in_flight: list[CompileJob] = []  # submitted, future not done yet
        self.max_compiles_in_flight = MAX_COMPILES_IN_FLIGHT
        self._backend_ready_at: float | None = None  # compile timeouts count from here at the earliest
        self._totals_lock = threading.Lock()  # pool threads add compile times
        self.totals = _Totals()

    # ------------------------------------------------------------ compiling

    def add_request(self, request: Request) -> None:
        """Start compiling ``request``'s grammar, or share a cached/in-flight one."""
        params = request.sampling_params.structured_outputs
        assert params is not None, "only constrained requests have grammars"
        key = params.cache_key
        job = self._cache.get(key)
        if job is None:
            job = self._submit(params)
            self._cache[key] = job
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        request.structured_output = StructuredOutputRequest(params, job)
        self.totals.num_requests += 1

    def split_compiled(
        self, requests: Iterable[Request]
    ) -> tuple[list[Request], list[tuple[Request, str]], list[Request]]:
        """Requests waiting for grammars -> (ready, failed with the reason, still compiling).

        A compile fails on a bad constraint, or once it has run longer than
        ``compile_timeout`` since it was submitted (queueing counts).
        """
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        pending: list[Request] = []
        for request in requests:
            if request.is_finished:
                continue  # aborted while compiling
            so_request = request.structured_output
            assert so_request is not None, "only constrained requests wait for grammars"
            error = self._compile_error(so_request)
            if error is not None:
                failed.append((request, error))
            elif so_request.job.future.done():
                assert self._backend is not None, "a compile that succeeded has built the backend"
                so_request.grammar = self._backend.new_grammar(so_request.job.future.result())
                ready.append(request)
            else:
                pending.append(request)
        return ready, failed, pending

    def _compile_error(self, so_request: StructuredOutputRequest) -> str | None:
        job = so_request.job
        if job.future.cancelled():  # timed out in the queue (for a request sharing the compile)
            return self._timeout_error(so_request)
        if not job.future.done():
            if self._backend_ready_at is None:
                return None  # the backend is still starting: no compile has had its chance yet
            since = max(job.submitted_at, self._backend_ready_at)
            if self._clock() - since > self.compile_timeout:
                job.future.cancel()  # one still queued never runs; a running one ends on its own
                if self._cache.get(so_request.params.cache_key) is job:
                    del self._cache[so_request.params.cache_key]
                return self._timeout_error(so_request)
            return None
        exc = job.future.exception()
        if exc is None:
            return None
        if self._cache.get(so_request.params.cache_key) is job:
            del self._cache[so_request.params.cache_key]  # cache successes only
        if isinstance(exc, ValueError):
            return str(exc)
        return f"Compiling the {so_request.params.kind} constraint failed: {type(exc).__name__}: {exc}"

    def _timeout_error(self, so_request: StructuredOutputRequest) -> str:
        return (
            f"Compiling the {so_request.params.kind} constraint took longer than "
            f"{self.compile_timeout:g}s (--structured-outputs-compile-timeout)."
        )

    def _submit(self, params: StructuredOutputsParams) -> CompileJob:
        if self._executor is None:
            self._executor = _DaemonPool(_COMPILE_THREADS, "grammar-compile")
        job = CompileJob(submitted_at=self._clock())
        self._in_flight = [j for j in self._in_flight if not j.future.done()]
        if len(self._in_flight) >= self.max_compiles_in_flight:
            job.future.set_exception(
                ValueError(
                    f"{len(self._in_flight)} constraints are compiling already (at most "
                    f"{self.max_compiles_in_flight}); retry the {params.kind} constraint later."
                )
            )
            return job
        self._executor.submit(job.future, self._compile, job, params)
        self._in_flight.append(job)
        return job

    def _compile(self, job: CompileJob, params: StructuredOutputsParams) -> Any:
        """On a pool thread: the backend's first use builds it (not timed)."""
        backend = self._get_backend()
        job.started_at = self._clock()
        compiled = backend.compile(params)
        self._record_compile(self._clock() - job.started_at)
        return compiled

    def _get_backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
                self._backend_ready_at = self._clock()
            return self._backend

    def _record_compile(self, seconds: float) -> None:
        with self._totals_lock:
            self.totals.compile_counts[bisect.bisect_left(COMPILE_TIME_BUCKETS, seconds)] += 1
            self.totals.compile_seconds += seconds

    # ---------------------------------------------------------- each step

    def filter_drafts(self, requests: Iterable[Request]) -> None:
        """Keep only the draft tokens (speculative decoding) each constrained
        request's grammar accepts: a draft it refuses can never be the output."""
        for request in requests:
            so_request = request.structured_output
            drafts = getattr(request, "spec_token_ids", None)
            if so_request is not None and so_request.grammar is not None and drafts:
                request.spec_token_ids = so_request.grammar.validate_tokens(list(drafts))

    def grammar_bitmask(
        self,
        requests: Iterable[Request],
        num_scheduled_tokens: dict[str, int],
        spec_tokens: dict[str, list[int]],
    ) -> tuple[list[str], np.ndarray | None]:
        """The masks of the constrained requests that sample this step.

        Call before ``num_computed_tokens`` advances. A request gets one row
        per position it samples: one per scheduled draft token, plus one.
        """
        start = time.perf_counter()
        sampling = [
            r
            for r in requests
            if r.structured_output is not None
            and r.num_computed_tokens + num_scheduled_tokens[r.request_id] >= r.num_tokens
        ]
        if not sampling:
            return [], None
        num_rows = sum(1 + len(spec_tokens.get(r.request_id, ())) for r in sampling)
        bitmask = np.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=np.int32)
        row = 0
        for request in sampling:
            row = self._fill_rows(request, spec_tokens.get(request.request_id, []), bitmask, row)
        self.totals.fill_seconds += time.perf_counter() - start
        self.totals.num_fill_steps += 1
        self.totals.num_fill_rows += num_rows
        return [r.request_id for r in sampling], bitmask

    @staticmethod
    def _fill_rows(request: Request, drafts: list[int], bitmask: np.ndarray, row: int) -> int:
        """Rows ``row..row + len(drafts)``: the mask before each draft and after
        the last, walking the grammar through the drafts and back."""
        assert request.structured_output is not None, "only constrained requests get masks"
        grammar = request.structured_output.grammar
        assert grammar is not None, "a request is scheduled only once its grammar compiled"
        num_accepted = 0
        for position in range(len(drafts) + 1):
            # A terminated grammar allows nothing more; its row stays all-ones
            # and the request stops on the token already sampled.
            if not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, row + position)
            if position < len(drafts) and grammar.accept_tokens([drafts[position]]):
                num_accepted += 1
        grammar.rollback(num_accepted)
        return row + len(drafts) + 1

    def accept_token(self, request: Request, token_id: int) -> bool:
        """Advance ``request``'s grammar over a token it just produced; True if
        that ends the request (its status says how: the grammar is complete,
        or -- a broken invariant, the mask forbade it -- refused the token)."""
        assert request.structured_output is not None, "only constrained requests have grammars"
        grammar = request.structured_output.grammar
        assert grammar is not None, "a request runs only once its grammar compiled"
        if not grammar.accept_tokens([token_id]):
            request.status = RequestStatus.FINISHED_ERROR
            request.error = f"The grammar refused token {token_id} that the model produced."
            return True
        if grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    # -------------------------------------------------------------- stats

    def make_stats(self) -> StructuredOutputStats | None:
        if self.totals.num_requests == 0:
            return None
        with self._totals_lock:
            return StructuredOutputStats(
                num_requests=self.totals.num_requests,
                compile_counts=list(self.totals.compile_counts),
                compile_seconds=self.totals.compile_seconds,
            )

    def shutdown(self) -> None:
        """Stop the pool: queued compiles never run, running ones are abandoned (daemon
        threads: they never hold up the process's exit)."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


R = TypeVar("R")
# A queued call: the future it resolves, the function and its arguments.
_Job = tuple[Future[Any], Callable[..., Any], tuple[object, ...]]


class _DaemonPool:
    """A fixed pool of daemon threads running submitted calls into Futures."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, future: Future[R], fn: Callable[..., R], *args: object) -> None:
        """Run ``fn(*args)`` on a pool thread into ``future`` (unless it is cancelled first)."""
        self._jobs.put((future, fn, args))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued (timed out)
            try:
                result = fn(*args)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancel what is queued and let each thread end after its current call."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)


def _xgrammar_backend(config: EngineConfig) -> StructuredOutputBackend:
    from services.engine_core.structured_output.xgrammar_backend import XgrammarBackend

    eos = config.model.eos_token_id
    return XgrammarBackend(config.model.tokenizer, config.model.vocab_size, [] if eos is None else [eos])
