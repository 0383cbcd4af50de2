"""EngineCoreProc: one data-parallel rank's EngineCore as its own process.

Run as ``python -m services.engine_core.proc --rank R --handshake-address ADDR``
(its flags: ``proc_args.EngineCoreArgs``; a plain subprocess: the config
arrives over the handshake, never pickled).

Three threads share the work, so socket I/O and (de)serialization overlap
the forward pass (both release the GIL):

- the input thread owns the input DEALER: it decodes request frames onto
  ``_inputs``, dropping malformed ones, and at the end says goodbye;
- the output thread owns the output DEALER (this process's identity, as on
  the input socket: the API takes outputs for our rank only from it): it sends what the busy loop puts on
  ``_outputs``, and a heartbeat with the latest stats when nothing went out
  for ``HEARTBEAT_S``, so a long step never looks like a dead engine; the
  heartbeat says how long the current step has run (``step_elapsed_s``), so a
  step that never ends (a hung worker, a TP collective that never returns)
  is seen by the API, which restarts the rank past ``--step-timeout``;
- the main thread runs the busy loop: drain inputs (blocking only when
  there is no work), ``engine.step()``, push outputs.

SIGTERM drains (``services.engine_core.drain``); a second SIGTERM, the API's
SHUTDOWN frame or a fatal error stops at once; the death of the launcher
kills it (Linux), so a crashed API or ``engine-core`` leaves no orphan.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from protocol import (
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
)
from protocol.codec import DecodeError, Decoder, Encoder
from protocol.curve import CLIENT, CurveKeys, load_keys
from protocol.engine import UtilityMethod, UtilityRequest, UtilityResult, has_deltas, without_deltas
from protocol.handshake import EngineDraining, EngineGoodbye, EngineHandshakeReply, EngineHello, EngineReady
from protocol.zmq_sockets import instance_identity, make_socket, recv, send, split
from services.config.kv_transfer_args import with_default_keys_dir, with_kv_transfer_config
from services.config.memory_plan import with_node_memory
from services.engine_core.devices import narrow_visible_devices
from services.engine_core.drain import Drain
from services.engine_core.kv_events import with_default_keys_dir as with_default_events_keys
from services.engine_core.proc_args import EngineCoreArgs, build_parser
from services.log_format import configure as configure_logging
from services.processes import DEFAULT_SHUTDOWN_TIMEOUT_S

if TYPE_CHECKING:
    from services.engine_core.core import EngineCore

logger = logging.getLogger(__name__)
# The payload decoder of each request type an engine accepts.
_Decoders = dict[EngineCoreRequestType, Decoder[Any]]

HEARTBEAT_S = 0.5
HANDSHAKE_TIMEOUT_S = 300.0
# How long a stopping engine waits for the API to acknowledge its goodbye.
GOODBYE_ACK_S = 2.0
# Outputs still queued when the process closes get this long to leave (ms).
OUTPUT_LINGER_MS = 4000
_POLL_MS = 100
_IDLE_WAIT_S = 0.1  # the busy loop's longest block, so a stop is noticed quickly
# After a step that changed nothing the API can see (e.g. requests that wait
# for blocks), yield this long to the input queue instead of spinning.
_STALL_WAIT_S = 0.001
# A hello can be lost or ignored (the API still thinks an earlier instance of
# this rank is alive): say it again this often until the API answers.
_HELLO_RESEND_S = 5.0


class EngineCoreProc:
    """Serves one built EngineCore on the API's data sockets until stopped."""

    def __init__(
        self,
        engine: EngineCore,
        ctx: zmq.SyncContext,
        reply: EngineHandshakeReply,
        stop: threading.Event,
        *,
        identity: bytes,
        drain: Drain | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        self.engine = engine
        self.rank = reply.config.parallel.data_parallel_rank
        self._stop = stop  # set by a second signal, a SHUTDOWN frame, or a fatal error
        self._drain = drain or Drain(stop, DEFAULT_SHUTDOWN_TIMEOUT_S)
        self._num_dropped = 0  # malformed input frames, reported in the stats
        self._goodbye_now = threading.Event()  # outputs flushed: the input thread may say goodbye
        self._reason = "stopped by a signal"  # what the goodbye tells the API
        self._inputs: queue.Queue[tuple[EngineCoreRequestType, object]] = queue.Queue()
        self._outputs: queue.Queue[EngineCoreOutputs | None] = queue.Queue()
        self._stats_dirty = True  # tell the API our (empty) load at once
        self._stalled = False
        self._latest_stats = SchedulerStats()
        # time.monotonic() when the step now running began; None between steps.
        # Written by the busy loop, read by the output thread (one reference: no lock).
        self._step_started: float | None = None
        self._input_sock = make_socket(
            ctx, zmq.DEALER, reply.input_address, bind=False, identity=identity, linger=1000, curve=curve
        )
        self._output_sock = make_socket(
            ctx,
            zmq.DEALER,
            reply.output_address,
            bind=False,
            identity=identity,
            linger=OUTPUT_LINGER_MS,
            curve=curve,
        )
        # First frame on the input socket: the API's ROUTER learns our identity from it.
        send(
            self._input_sock,
            Encoder(),
            EngineReady(
                rank=self.rank, num_blocks=engine.num_blocks, max_model_len=engine.config.model.max_model_len
            ),
        )
        self._executor_failed = False
        engine.executor.register_failure_callback(self._on_executor_failure)
        self._input_thread = threading.Thread(target=self._input_loop, name="engine-input", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="engine-output", daemon=True)

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        self._input_thread.start()
        self._output_thread.start()
        self._drain.begin_serving()
        code = 0
        try:
            while not self._stop.is_set():
                self._process_input_queue()
                self._step()
                self._check_drain()
        except Exception as e:
            logger.exception("Engine core rank %d failed", self.rank)
            self._reason = f"engine error: {e}"
            code = 1
        finally:
            self._close()
        return 1 if self._executor_failed else code

    def _on_executor_failure(self, reason: str) -> None:
        """A worker process died (called from the executor's monitor thread):
        stop, tell the API why, and exit non-zero."""
        self._executor_failed = True
        self._reason = f"engine error: {reason}"
        self._stop.set()

    # ---- busy loop (main thread)

    def _process_input_queue(self) -> None:
        # A paused engine holds requests but has no work: it blocks on its inputs.
        idle = not (self.engine.has_work() or self._stats_dirty)
        wait_s = _IDLE_WAIT_S if idle else _STALL_WAIT_S if self._stalled else 0.0
        while not self._stop.is_set():
            try:
                kind, payload = self._inputs.get(timeout=wait_s) if wait_s else self._inputs.get_nowait()
            except queue.Empty:
                if not idle or self._drain.requested.is_set():
                    return
                continue
            idle, wait_s = False, 0.0
            self._handle(kind, payload)

    def _handle(self, kind: EngineCoreRequestType, payload: object) -> None:
        # Each kind's payload is what its decoder in _input_loop produced.
        self._stats_dirty = True
        if kind is EngineCoreRequestType.ADD:
            assert isinstance(payload, EngineCoreRequest)
            self._add(payload)
        elif kind is EngineCoreRequestType.ABORT:
            assert isinstance(payload, list)
            self.engine.abort_requests(payload)
        elif kind is EngineCoreRequestType.SHUTDOWN:
            self._reason = "the API asked it to stop"
            self._stop.set()
        elif kind is EngineCoreRequestType.DRAIN:
            self._drain.acknowledged = True  # every ADD the API sent is handled by now
        elif kind is EngineCoreRequestType.UTILITY:
            assert isinstance(payload, UtilityRequest)
            self._outputs.put(EngineCoreOutputs(engine_index=self.rank, utility_output=self._call(payload)))

    def _call(self, call: UtilityRequest) -> UtilityResult:
        methods = {
            UtilityMethod.RESET_PREFIX_CACHE: self.engine.reset_prefix_cache,
            UtilityMethod.PAUSE: self.engine.pause,
            UtilityMethod.RESUME: self.engine.resume,
        }
        try:
            return UtilityResult(call.call_id, ok=methods[call.method]())
        except Exception as e:  # the engine keeps serving; the API reports a 500
            logger.exception("Rank %d: utility call %s failed", self.rank, call.method.value)
            return UtilityResult(call.call_id, ok=False, error=f"{type(e).__name__}: {e}")

    def _check_drain(self) -> None:
        stats = self._latest_stats
        held = 0
        if self.engine.has_unfinished_requests():  # the stats may lag a step: never read 0 then
            held = max(1, stats.num_running_reqs + stats.num_waiting_reqs)
        reason = self._drain.stop_reason(held)
        if reason is not None:
            logger.info("Rank %d stops: %s.", self.rank, reason)
            self._reason = reason
            self._stop.set()

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.engine.add_request(request)
        except ValueError as e:
            # The request failed on its own; the engine is fine and keeps serving.
            logger.info(
                "Rejected request %s: %s", request.request_id, e, extra={"request_id": request.request_id}
            )
            error = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=str(e),
                timestamp=time.monotonic(),
                engine_index=self.rank,
            )
            self._outputs.put(EngineCoreOutputs(engine_index=self.rank, outputs=[error]))

    def _step(self) -> None:
        if not (self.engine.has_work() or self._stats_dirty):
            return
        self._stats_dirty = False
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        finally:
            self._step_started = None
        stats = outputs.scheduler_stats
        # Stats carry deltas (prefix hits, preemptions): a step that counted
        # anything, or whose stats differ in anything but the step counter,
        # must reach the API.
        changed = stats is not None and (
            has_deltas(stats)
            or msgspec.structs.replace(stats, step_counter=0)
            != msgspec.structs.replace(self._latest_stats, step_counter=0)
        )
        self._stalled = not (outputs.outputs or changed)
        if stats is not None:
            self._latest_stats = stats
        if not self._stalled:
            self._outputs.put(outputs)

    def _close(self) -> None:
        self._stop.set()
        self.engine.shutdown()
        self._outputs.put(None)
        self._output_thread.join()
        # The goodbye goes last, after every output was handed to ZMQ.
        self._goodbye_now.set()
        self._input_thread.join()
        self._input_sock.close()
        self._output_sock.close()

    # ---- output thread

    def _output_loop(self) -> None:
        encoder = Encoder()
        while True:
            try:
                outputs = self._outputs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                outputs = self._heartbeat()
            if outputs is None:
                return
            if outputs.scheduler_stats is not None:
                outputs.scheduler_stats.num_dropped_frames = self._num_dropped
            send(self._output_sock, encoder, outputs)

    def _heartbeat(self) -> EngineCoreOutputs:
        # The counters in stats are deltas already reported: zero them here.
        stats = without_deltas(self._latest_stats)
        started = self._step_started
        if started is not None:
            stats.step_elapsed_s = time.monotonic() - started
        return EngineCoreOutputs(engine_index=self.rank, scheduler_stats=stats)

    # ---- input thread

    def _input_loop(self) -> None:
        decoders: _Decoders = {
            EngineCoreRequestType.ADD: Decoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: Decoder(list[str]),
            EngineCoreRequestType.UTILITY: Decoder(UtilityRequest),
        }
        while not self._goodbye_now.is_set():
            if self._input_sock.poll(_POLL_MS):
                self._read_input(decoders)
            if self._drain.requested.is_set() and not self._drain.announced:
                send(
                    self._input_sock,
                    Encoder(),
                    EngineDraining(rank=self.rank, timeout_s=self._drain.timeout_s),
                )
                self._drain.announced = True
        self._say_goodbye()

    def _read_input(self, decoders: _Decoders) -> None:
        frames = self._input_sock.recv_multipart(copy=False)
        try:
            kind, payload = _decode_request(frames, decoders)
        except ValueError as e:
            self._num_dropped += 1
            if self._num_dropped % 100 == 1:  # a flood of garbage must not flood the log
                logger.warning(
                    "Rank %d dropped a malformed input message (%d so far): %s",
                    self.rank,
                    self._num_dropped,
                    e,
                )
            return
        if kind is EngineCoreRequestType.SHUTDOWN:
            self._reason = "the API asked it to stop"
            self._stop.set()
        self._inputs.put((kind, payload))

    def _say_goodbye(self) -> None:
        """Tell the API we stop, and wait (bounded) for its SHUTDOWN ack:
        ``ipc://`` may drop the last message of a process that exits at once."""
        send(self._input_sock, Encoder(), EngineGoodbye(rank=self.rank, reason=self._reason))
        deadline = time.monotonic() + GOODBYE_ACK_S
        while (left := deadline - time.monotonic()) > 0:
            if not self._input_sock.poll(int(left * 1000) + 1):
                break
            frames = self._input_sock.recv_multipart()
            if frames and frames[0] == EngineCoreRequestType.SHUTDOWN.value:
                return
        logger.info("Rank %d: no acknowledgement of its goodbye; the API may be gone.", self.rank)


def _decode_request(
    frames: Sequence[zmq.Frame | bytes], decoders: _Decoders
) -> tuple[EngineCoreRequestType, object]:
    """``[type byte, payload...]`` -> (type, decoded payload); ValueError if malformed."""
    if not frames:
        raise ValueError("empty message")
    first = frames[0].bytes if isinstance(frames[0], zmq.Frame) else bytes(frames[0])
    try:
        kind = EngineCoreRequestType(first)
    except ValueError:
        raise ValueError(f"unknown request type byte {first[:4]!r}") from None
    body = split(frames, 1)[1] if len(frames) > 1 else []
    if kind in (EngineCoreRequestType.SHUTDOWN, EngineCoreRequestType.DRAIN):
        return kind, None
    if not body:
        raise ValueError(f"{kind.name} message without a payload")
    if kind not in decoders:
        raise ValueError(f"{kind.name} messages are not accepted here")
    return kind, decoders[kind].decode(body)


def handshake(
    ctx: zmq.SyncContext,
    *,
    rank: int,
    address: str,
    local: bool,
    headless: bool,
    stop: threading.Event,
    identity: bytes,
    curve: CurveKeys | None = None,
) -> EngineHandshakeReply | None:
    """Say hello to the API and return its reply (None if stopped meanwhile).

    ``identity`` is this process's (``instance_identity``): the API binds the
    rank to it, so the input socket must use the same one.
    A reply that does not decode is dropped, and the hello said again."""
    sock = make_socket(ctx, zmq.DEALER, address, bind=False, identity=identity, curve=curve)
    decoder, encoder = Decoder(EngineHandshakeReply), Encoder()
    hello = EngineHello(rank=rank, local=local, headless=headless)
    try:
        start = last_log = time.monotonic()
        last_hello = -_HELLO_RESEND_S
        while not stop.is_set():
            if time.monotonic() - last_hello >= _HELLO_RESEND_S:
                send(sock, encoder, hello)
                last_hello = time.monotonic()
            if sock.poll(_POLL_MS):
                try:
                    _, reply = recv(sock, decoder)
                except DecodeError as e:
                    logger.warning("Rank %d dropped a malformed handshake reply: %s", rank, e)
                    continue
                if reply.config.parallel.data_parallel_rank != rank:
                    raise ValueError(
                        f"The API sent the config of rank "
                        f"{reply.config.parallel.data_parallel_rank} to rank {rank}."
                    )
                return reply
            now = time.monotonic()
            if now - start > HANDSHAKE_TIMEOUT_S:
                raise TimeoutError(
                    f"Rank {rank}: no handshake reply from {address} in {HANDSHAKE_TIMEOUT_S:.0f}s."
                )
            if now - last_log > 10:
                logger.info("Rank %d is waiting for the API at %s", rank, address)
                last_log = now
        return None
    finally:
        sock.close()


def report_start_failure(
    ctx: zmq.SyncContext,
    reply: EngineHandshakeReply,
    rank: int,
    reason: str,
    *,
    identity: bytes,
    curve: CurveKeys | None = None,
) -> None:
    """Say goodbye, with why, to an API this engine shook hands with but never served; wait
    (bounded) for its acknowledgement, as a stopping engine does."""
    sock = make_socket(
        ctx, zmq.DEALER, reply.input_address, bind=False, identity=identity, linger=1000, curve=curve
    )
    try:
        send(sock, Encoder(), EngineGoodbye(rank=rank, reason=reason))
        if not sock.poll(int(GOODBYE_ACK_S * 1000)):
            logger.info("Rank %d: no acknowledgement of its goodbye; the API may be gone.", rank)
    finally:
        sock.close()


def with_num_threads(config: EngineConfig, num_threads: int | None) -> EngineConfig:
    if num_threads is None:
        return config
    if num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {num_threads}.")
    return msgspec.structs.replace(
        config, device=msgspec.structs.replace(config.device, num_threads=num_threads)
    )


def with_tensor_parallel_size(config: EngineConfig, size: int | None) -> EngineConfig:
    """This node's worker count, when it differs from the API's config (the API runs no model)."""
    if size is None:
        return config
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}.")
    return msgspec.structs.replace(
        config, parallel=msgspec.structs.replace(config.parallel, tensor_parallel_size=size)
    )


def run_engine_core(
    *,
    rank: int,
    handshake_address: str,
    local: bool = False,
    headless: bool = False,
    num_threads: int | None = None,
    curve_keys: str | None = None,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    tensor_parallel_size: int | None = None,
    kv_transfer_config: str | None = None,
    engines_on_node: int | None = None,
    available_memory: int | None = None,
    local_dp_rank: int | None = None,
) -> int:
    stop = threading.Event()
    drain = Drain(stop, shutdown_timeout_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, drain.on_signal)
    curve = load_keys(curve_keys, CLIENT) if curve_keys is not None else None
    ctx = zmq.Context()
    identity = instance_identity(rank)
    try:
        reply = handshake(
            ctx,
            rank=rank,
            address=handshake_address,
            local=local,
            headless=headless,
            stop=stop,
            identity=identity,
            curve=curve,
        )
        if reply is None:
            return 0
        config = with_tensor_parallel_size(with_num_threads(reply.config, num_threads), tensor_parallel_size)
        config = with_default_keys_dir(with_kv_transfer_config(config, kv_transfer_config), curve_keys)
        config = msgspec.structs.replace(
            config, kv_events=with_default_events_keys(config.kv_events, curve_keys)
        )
        if engines_on_node is not None:  # started by engine-core --headless: its node, not the API's
            config = with_node_memory(config, engines_on_node, available_memory)
        reply = msgspec.structs.replace(reply, config=config)
        start = time.monotonic()
        logger.info("Engine core rank %d: loading torch, its kernels and the model ...", rank)
        if config.device.device in ("cuda", "auto"):  # before torch reads it, and any worker starts
            try:
                narrow_visible_devices(local_dp_rank, config.parallel.tensor_parallel_size)
            except ValueError as e:
                if config.device.device == "cuda":
                    raise
                # auto: this node may have no GPU at all; a GPU node short of devices is refused
                # with the count once the engine resolves auto (services/config/engine_device.py).
                logger.warning("%s", e)
        import torch  # the engine process is where torch lives

        torch.set_num_threads(config.device.num_threads)
        from services.engine_core.core import EngineCore

        try:
            engine = EngineCore(config)
        except Exception as e:
            # A configuration or memory error: say so to the API (it stops rather than restart
            # an engine that never served), then exit non-zero.
            if isinstance(e, ValueError):  # says what to change: no traceback needed
                logger.error("Engine core rank %d failed to start: %s", rank, e)
            else:
                logger.exception("Engine core rank %d failed to start", rank)
            report_start_failure(ctx, reply, rank, f"{type(e).__name__}: {e}", identity=identity, curve=curve)
            return 1
        logger.info(
            "Engine core rank %d ready (%d KV blocks) in %.1f s.",
            rank,
            engine.num_blocks,
            time.monotonic() - start,
        )
        return EngineCoreProc(engine, ctx, reply, stop, identity=identity, drain=drain, curve=curve).run()
    finally:
        ctx.term()


def die_with_launcher() -> None:
    """Linux: have the kernel SIGKILL this process when the thread that started
    it exits (PR_SET_PDEATHSIG), so a launcher killed by anything, SIGKILL
    included, leaves no engine behind. Launchers start engines from a
    long-lived thread for that reason."""
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d).", ctypes.get_errno())
    elif os.getppid() != launcher:  # it died before the call took effect
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    args = EngineCoreArgs.parse(argv)
    configure_logging(  # text or json, as the launcher's --log-format (WEFT_LOG_FORMAT)
        rank=args.rank,
        process="engine-core",
        text_format=f"%(asctime)s %(levelname)s [engine {args.rank}] %(name)s: %(message)s",
    )
    if args.curve_keys is not None:
        try:
            load_keys(args.curve_keys, CLIENT)  # refuse a bad folder before loading a model
        except ValueError as e:
            build_parser().error(str(e))
    return run_engine_core(**dataclasses.asdict(args))


if __name__ == "__main__":
    sys.exit(main())
