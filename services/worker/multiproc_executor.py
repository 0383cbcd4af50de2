"""MultiprocExecutor: one engine core driving ``tensor_parallel_size`` worker processes.

Each call (``protocol.executor``) is encoded once with the wire codec and
published once on a ZMQ XPUB socket (``ipc://``) that every worker
subscribes to; the workers answer on one PULL socket. A step is answered by
the driver (rank 0) alone, with the ``ModelRunnerOutput``; the other ranks
answer a step only when it fails on them, which fails the executor (the
other calls, rare, are answered by every rank). Nothing is pickled: the workers
receive their config as msgpack bytes and their calls as codec frames.

XPUB rather than PUB: it hands the executor each worker's subscription, so
the first call is sent only once every worker can receive it (a PUB drops
messages to subscribers that have not finished joining).

A monitor thread waits on the workers' process sentinels. If one dies, the
executor is failed: the call in progress (or the next one) raises with the
rank, pid and exit code, and the failure callbacks run at once, so an idle
engine core notices too.

Workers are ``spawn``ed (never forked: the engine core has threads and may
have touched CUDA), so a script that builds an ``LLM`` with tensor
parallelism needs the usual ``if __name__ == "__main__":`` guard. They die
with the thread that built the executor (``PR_SET_PDEATHSIG``): build it on
a thread that lives as long as the engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from protocol import EngineConfig, ModelRunnerOutput, SchedulerOutput
from protocol.codec import Decoder, Encoder
from protocol.executor import (
    DetermineNumBlocks,
    ExecuteModel,
    InitializeCache,
    StopWorker,
    WorkerCall,
    WorkerReply,
)
from protocol.zmq_sockets import bound_address, ipc_address, make_socket, recv
from services.ports import free_port
from services.worker import worker_proc
from services.worker.executor import DEFAULT_WORKER_CLASS, Executor
from services.worker.worker_proc import DRIVER_RANK

logger = logging.getLogger(__name__)

_POLL_MS = 50  # how often a waiting call checks whether a worker died
_STOP_GRACE_S = 5.0  # a healthy worker's time to leave its loop after StopWorker
_KILL_GRACE_S = 2.0  # SIGTERM -> SIGKILL
_DEATH_WAIT_S = 0.5  # after a rank's error, how long to look for a peer's death that caused it


class WorkerFailedError(RuntimeError):
    """A worker process died or failed; this executor cannot run another step."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, worker_class: str = DEFAULT_WORKER_CLASS) -> None:
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        self._failure: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._ctx = zmq.Context()
        self._calls = make_socket(self._ctx, zmq.XPUB, ipc_address("tp-calls"), bind=True)
        self._calls.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per worker
        self._replies = make_socket(self._ctx, zmq.PULL, ipc_address("tp-replies"), bind=True)
        self._encoder = Encoder()
        self._decoder = Decoder(WorkerReply)
        self._wake_monitor, self._monitor_waker = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch_workers, name="tp-worker-monitor", daemon=True)
        self.processes: list[multiprocessing.Process] = []
        try:
            self._spawn(config, worker_class)
            self._monitor.start()
            self._wait_for_subscriptions()
            self._collect("start-up")
        except BaseException:
            self.shutdown()
            raise

    # ---- Executor

    def determine_num_blocks(self) -> int:
        """The fewest blocks any rank can hold: every rank stores the same block ids."""
        replies = self._call(DetermineNumBlocks())
        return min(reply.num_blocks for reply in replies)

    def initialize_cache(self, num_blocks: int) -> None:
        self._call(InitializeCache(num_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        (reply,) = self._call(ExecuteModel(scheduler_output), ranks=[DRIVER_RANK])
        return reply.output or ModelRunnerOutput()

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            failure = self._failure
            self._failure_callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def shutdown(self) -> None:
        """Stop the workers (politely when they are healthy), then close the sockets; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._failure is None:
            self._publish(StopWorker())
        _stop_processes(self.processes, grace_s=_STOP_GRACE_S if self._failure is None else 0.0)
        self._monitor_waker.send(None)
        if self._monitor.is_alive():
            self._monitor.join()
        self._calls.close()
        self._replies.close()
        self._ctx.term()

    # ---- calls

    def _call(self, call: WorkerCall, ranks: list[int] | None = None) -> list[WorkerReply]:
        if self._closed:
            raise RuntimeError("The executor was shut down.")
        self._raise_if_failed(type(call).__name__)
        self._publish(call)
        return self._collect(type(call).__name__, ranks)

    def _publish(self, call: WorkerCall) -> None:
        self._calls.send_multipart(self._encoder.encode(call), copy=False)

    def _collect(self, what: str, ranks: list[int] | None = None) -> list[WorkerReply]:
        """The replies of ``ranks`` (default: all), in rank order. Raises on a
        death, or on an error from any rank (a follower's may be about the
        previous step, which it alone had not finished)."""
        wanted = list(range(self.world_size)) if ranks is None else ranks
        replies: dict[int, WorkerReply] = {}
        while len(replies) < len(wanted):
            if not self._replies.poll(_POLL_MS):
                self._raise_if_failed(what)
                continue
            _, reply = recv(self._replies, self._decoder)
            self._raise_if_error(reply, what)
            replies[reply.rank] = reply
        return [replies[rank] for rank in wanted]

    def _raise_if_error(self, reply: WorkerReply, what: str) -> None:
        if reply.error is None:
            return
        message = f"Tensor-parallel worker rank {reply.rank} failed in {what}: {reply.error}"
        # A rank that dies breaks its peers' collectives, and their errors
        # ("connection closed by peer") can arrive before its death is seen:
        # name the death first, it is the cause.
        death = self._death_of_any(
            timeout_s=_DEATH_WAIT_S, besides=reply.rank
        )  # it exits after failing to start
        if death is not None:
            message = f"{death} Then: {message}"
        self._fail(message)
        bad_config = reply.error_type == "ValueError" and death is None
        raise (ValueError if bad_config else WorkerFailedError)(message)

    def _raise_if_failed(self, what: str) -> None:
        if self._failure is None:
            return
        # A worker that fails says why, then exits: prefer its words to "it died".
        while self._replies.poll(_POLL_MS):
            self._raise_if_error(recv(self._replies, self._decoder)[1], what)
        raise WorkerFailedError(self._failure)

    def _wait_for_subscriptions(self) -> None:
        subscribed = 0
        while subscribed < self.world_size:
            if self._calls.poll(_POLL_MS):
                if self._calls.recv()[:1] == b"\x01":  # b"\x01" + topic subscribes, b"\x00" unsubscribes
                    subscribed += 1
            else:
                self._raise_if_failed("start-up")

    # ---- failures

    def _fail(self, reason: str) -> None:
        """Record the first failure and tell the callbacks (any thread)."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = reason
            callbacks = list(self._failure_callbacks)
        logger.error("%s", reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                logger.exception("An executor failure callback failed")

    def _watch_workers(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.processes] + [self._wake_monitor])
        if self._closed:
            return
        death = self._death_of_any(timeout_s=0.0)
        if death is not None:
            self._fail(death)

    def _death_of_any(self, timeout_s: float, besides: int | None = None) -> str | None:
        """How the first worker (but rank ``besides``) that exited died,
        waiting up to ``timeout_s`` for one; None if they all live."""
        others = [p for rank, p in enumerate(self.processes) if rank != besides]
        ready = set(multiprocessing.connection.wait([p.sentinel for p in others], timeout_s))
        for rank, process in enumerate(self.processes):
            if process.sentinel in ready:
                process.join(timeout=1.0)
                return (
                    f"Tensor-parallel worker rank {rank} (pid {process.pid}) died unexpectedly "
                    f"({_describe_exit(process.exitcode)})."
                )
        return None

    # ---- start-up

    def _spawn(self, config: EngineConfig, worker_class: str) -> None:
        context = multiprocessing.get_context("spawn")
        config_msgpack = msgspec.msgpack.encode(worker_config(config))
        init_method = free_tcp_init_method() if self.world_size > 1 else None
        for rank in range(self.world_size):
            process = context.Process(
                target=worker_proc.main,
                name=f"weft-tp-worker-{rank}",
                daemon=True,
                kwargs=dict(
                    rank=rank,
                    config_msgpack=config_msgpack,
                    distributed_init_method=init_method,
                    call_address=bound_address(self._calls),
                    reply_address=bound_address(self._replies),
                    worker_class=worker_class,
                    parent_pid=os.getpid(),
                ),
            )
            process.start()
            self.processes.append(process)  # as it starts: a failed start-up stops those already running


def worker_config(config: EngineConfig) -> EngineConfig:
    """The config each worker gets: the engine core's torch threads divided among its ranks."""
    threads = max(1, config.device.num_threads // config.parallel.tensor_parallel_size)
    return msgspec.structs.replace(config, device=msgspec.structs.replace(config.device, num_threads=threads))


def free_tcp_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://`` rendezvous address for torch.distributed, on a port free a moment ago."""
    return f"tcp://{host}:{free_port(host)}"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _stop_processes(processes: list[multiprocessing.Process], grace_s: float) -> None:
    """Wait up to ``grace_s`` for them to exit, then SIGTERM, then SIGKILL."""
    _join_all(processes, grace_s)
    for process in processes:
        if process.is_alive():
            process.terminate()
    _join_all(processes, _KILL_GRACE_S)
    for process in processes:
        if process.is_alive():
            logger.warning("Tensor-parallel worker %s ignored SIGTERM; killing it.", process.name)
            process.kill()
            process.join()


def _join_all(processes: list[multiprocessing.Process], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
