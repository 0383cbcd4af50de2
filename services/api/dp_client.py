"""DPLBEngineClient: the API's client of N data-parallel engine cores.

Sockets (all bound here; engines connect):

- handshake ROUTER: answers each engine's hello with its config and the
  data addresses;
- input ROUTER: requests out, addressed by rank identity; engines' ready,
  draining and goodbye messages in;
- output ROUTER: ``EngineCoreOutputs`` from every rank (outputs, load stats,
  heartbeats), each taken only from the identity bound to its rank.

With ``curve`` keys every socket is a CurveZMQ server and only engines
holding the client key get in (``protocol.curve``); a frame that does not
decode is counted (``dropped_frames()``) and dropped.

Requests go to the ready rank with the lowest ``4 * waiting + running``, as
vLLM's DPLBAsyncMPClient does, or, with a ``PrefixRouter``, by the prefix
each rank caches within a load bound (``services/api/prefix_router.py``).
A rank's life: ``waiting`` (until its hello and ready) -> ``ready`` ->
``draining`` (it was told to stop: it finishes what it holds, gets nothing new) -> ``dead`` (its process exited, it said
goodbye, it was silent for ``silence_timeout_s``, or it is hung: its heartbeat
says one step has run past ``step_timeout_s``, ``--step-timeout``): its in-flight requests
then fail with ``EngineDeadError`` (a 500), and a local one is killed and restarted. A dead rank that says hello again (a
local one restarted by ``LocalEngines``, a headless one restarted by the
operator) is handed its config and rejoins once ready; a headless rank that
was only silent (a network blip, a long stall) rejoins as soon as it is
heard again, and is told to abort what it held (a hung one once its heartbeat
shows it left the stuck step).

A local rank that dies before it was ever ready (a configuration or memory
error: the engine's goodbye says which) is a start failure, not a crash:
it is not restarted, and ``start_failure`` tells ``weft serve`` to stop
with that error. Each rank's ready message carries the context it serves
(it may have lowered the config's ``max_model_len`` to what its KV cache
holds); ``max_model_len`` is the shortest of them, which the API checks
prompts against.

A rank is bound to the connection that shook hands for it: each engine
process has its own identity (``instance_identity``), which the hello
reveals and every later message must come from. A hello for a live rank, or
a status message from another identity, is refused and counted
(``dropped_frames()["rank_claim"]``): a peer cannot take over a rank's
traffic, nor say goodbye or draining for it. Outputs come over a ROUTER
too, from the engine's same identity: outputs, stats and heartbeats for a
rank from any other connection are refused and counted, so a peer cannot
keep a hung rank "ready" or forge its results, CURVE or not. With CURVE
the rank is also bound to the key its hello came with (``client`` or a per-node key, see
``protocol.curve``): status messages and outputs for it must come over
connections authenticated with that key, so one node cannot speak for a
rank another node serves. The input ROUTER is
ROUTER_MANDATORY: a request for a rank whose connection is gone fails at
once with ``EngineDeadError`` instead of vanishing.
Torch-free: nothing here may import torch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import time
from collections.abc import AsyncGenerator, Sequence

import msgspec
import zmq
import zmq.asyncio

from protocol import (
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
)
from protocol.codec import Decoder, Encoder
from protocol.curve import CurveKeys, ZapAuthenticator
from protocol.engine import UtilityMethod, UtilityRequest, UtilityResult
from protocol.handshake import (
    EngineDraining,
    EngineGoodbye,
    EngineHandshakeReply,
    EngineHello,
    EngineReady,
    EngineStatus,
)
from protocol.zmq_sockets import (
    asend,
    bound_address,
    identity_rank,
    ipc_address,
    is_tcp,
    is_unreachable,
    make_socket,
    split,
    tcp_address,
    tcp_host,
)
from services.api.engine_client import (
    DEFAULT_STEP_TIMEOUT_S,
    EngineClient,
    EngineDeadError,
    EngineNotReadyError,
    RankStats,
    add_deltas,
)
from services.api.engine_processes import LocalEngines, launch_local_engines, stop_processes
from services.api.prefix_router import PrefixRouter

__all__ = ["DPLBEngineClient", "launch_local_engines", "stop_processes"]

logger = logging.getLogger(__name__)

_MONITOR_S = 0.2
_WAITING_LOG_S = 5.0
_SHUTDOWN_WAIT_S = 5.0
# An engine answers a utility call between two steps; a longer wait means it is stuck.
_UTILITY_TIMEOUT_S = 60.0
# Ranks that serve requests (ready) or finish the ones they hold (draining).
_LIVE = ("ready", "draining")


class DPLBEngineClient(EngineClient):
    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        num_ranks: int,
        local_processes: Sequence[subprocess.Popen] = (),
        *,
        local_start_rank: int = 0,
        silence_timeout_s: float = 3.0,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        curve: CurveKeys | None = None,
        restart_local: bool = False,
        prefix_router: PrefixRouter | None = None,
        data_ports: tuple[int, int] = (0, 0),
    ) -> None:
        """``local_processes[i]`` is rank ``local_start_rank + i``'s process (this node started it);
        with ``restart_local`` one that dies is started again (with back-off). With a
        ``prefix_router`` ranks are chosen by cached prefix and load, else by load alone.
        ``data_ports``: the input and output sockets' TCP ports when the handshake is TCP
        (0: any free port)."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be at least 1, got {num_ranks}.")
        if not 0 <= local_start_rank <= local_start_rank + len(local_processes) <= num_ranks:
            raise ValueError(
                f"Local ranks {local_start_rank}..{local_start_rank + len(local_processes) - 1} "
                f"do not fit in {num_ranks} ranks."
            )
        self.config = config
        self.handshake_address = handshake_address
        self.num_ranks = num_ranks
        self.silence_timeout_s = silence_timeout_s
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be positive, got {step_timeout_s}.")
        self.step_timeout_s = step_timeout_s
        self.curve = curve
        self.data_ports = {"input": data_ports[0], "output": data_ports[1]}
        self.local = LocalEngines(
            dict(enumerate(local_processes, start=local_start_rank)), restart=restart_local
        )
        self._stats = {rank: RankStats(rank=rank) for rank in range(num_ranks)}
        self._last_seen: dict[int, float] = {}
        self._identity: dict[int, bytes] = {}  # rank -> the identity that shook hands for it
        self._peer_host: dict[int, str | None] = {}  # rank -> its handshake's tcp peer host (None: ipc)
        self._key_name: dict[int, str | None] = {}  # rank -> the CURVE key its hello came with
        # Ranks dead because they went quiet (or their connection dropped),
        # and the requests they held: heard again, they rejoin and abort those.
        self._quiet: dict[int, set[str]] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._holder: dict[str, int] = {}
        self._encoder = Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: ZapAuthenticator | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        # Frames that failed to decode, by the socket they came in on.
        self._dropped_frames = {"handshake": 0, "status": 0, "output": 0, "rank_claim": 0}
        self.prefix_router = prefix_router
        # Utility calls sent and not answered: call id -> (rank, its answer).
        self._utility_calls: dict[int, tuple[int, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        # Each rank's context as it reported it when ready (it may have lowered the config's).
        self._max_model_len: dict[int, int] = {}
        self._ever_ready: set[int] = set()
        self._start_failure: str | None = None

    # ---- lifecycle

    async def start(self) -> None:
        if self._ctx is not None:
            raise RuntimeError("DPLBEngineClient.start() was already called.")
        self._ctx = zmq.asyncio.Context()
        if self.curve is not None:
            self._auth = ZapAuthenticator(self._ctx, self.curve)  # before any socket accepts a peer
        self._handshake_sock = self._bind(zmq.ROUTER, self.handshake_address)
        self.handshake_address = bound_address(self._handshake_sock)
        self._input_sock = self._bind(
            zmq.ROUTER, self._data_address("input"), linger=1000, router_mandatory=True
        )
        self._output_sock = self._bind(zmq.ROUTER, self._data_address("output"))
        self.input_address = bound_address(self._input_sock)
        self.output_address = bound_address(self._output_sock)
        if self.prefix_router is not None:
            self.prefix_router.start(self._ctx, self.curve)
        for coro in (self._handshake_loop(), self._status_loop(), self._output_loop(), self._monitor_loop()):
            task = asyncio.create_task(coro, name=coro.__name__)
            task.add_done_callback(_log_task_failure)
            self._tasks.append(task)

    def _bind(
        self, socket_type: int, address: str, linger: int = 0, router_mandatory: bool = False
    ) -> zmq.asyncio.Socket:
        return make_socket(
            self._ctx,
            socket_type,
            address,
            bind=True,
            linger=linger,
            curve=self.curve,
            router_mandatory=router_mandatory,
        )

    def _data_address(self, name: str) -> str:
        # Remote ranks reach the data sockets on the host they reached the handshake on.
        if is_tcp(self.handshake_address):
            return tcp_address(tcp_host(self.handshake_address), self.data_ports[name], bind=True)
        return ipc_address(name)

    async def shutdown(self) -> None:
        if self._ctx is None or self._closing:
            return
        self._closing = True
        self.local.restart = False
        # Only live ranks are connected to the input socket; local ones still
        # starting get SIGTERM below, remote ones time out their handshake.
        live = [rank for rank, s in self._stats.items() if s.state in _LIVE]
        for rank in live:
            await self._send(rank, EngineCoreRequestType.SHUTDOWN)
        # Each live rank answers with its goodbye (handled by _status_loop).
        deadline = time.monotonic() + _SHUTDOWN_WAIT_S
        while time.monotonic() < deadline and any(self._stats[r].state != "dead" for r in live):
            await asyncio.sleep(_MONITOR_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.prefix_router is not None:
            await self.prefix_router.stop()
        for rank in list(self._stats):
            self._mark_dead(rank, "the API shut down")
        # Engines that said goodbye are exiting: let them, before any SIGTERM.
        await asyncio.to_thread(self.local.stop, exit_wait_s=_SHUTDOWN_WAIT_S)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)

    # ---- EngineClient

    @property
    def ready(self) -> bool:
        return all(s.state == "ready" for s in self._stats.values())

    def rank_stats(self) -> dict[int, RankStats]:
        return self._stats

    def dropped_frames(self) -> dict[str, int]:
        return dict(self._dropped_frames)

    @property
    def max_model_len(self) -> int | None:
        # The shortest: a request may go to any rank.
        return min(self._max_model_len.values(), default=None)

    @property
    def start_failure(self) -> str | None:
        return self._start_failure

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        request_id = request.request_id
        if request_id in self._holder:
            raise ValueError(f"Request id {request_id!r} is already in flight.")
        rank = self._choose_rank(request)
        stats = self._stats[rank]
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._holder[request_id] = rank
        stats.in_flight.add(request_id)
        stats.num_routed += 1
        stats.num_waiting += 1  # counted until the rank's next stats replace it
        finished = False
        try:
            await self._send(rank, EngineCoreRequestType.ADD, request)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            # The one ABORT of a request closed early (stop string, client gone).
            self._forget(request_id)
            if not finished and self._stats[rank].state in _LIVE:
                await self._send(rank, EngineCoreRequestType.ABORT, [request_id])

    async def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._holder.get(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            for request_id in ids:
                self._finish_locally(
                    request_id,
                    EngineCoreOutput(
                        request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT
                    ),
                )
            if self._stats[rank].state in _LIVE:
                await self._send(rank, EngineCoreRequestType.ABORT, ids)

    async def call_utility(self, method: UtilityMethod) -> dict[int, bool]:
        ranks = [rank for rank, s in self._stats.items() if s.state in _LIVE]
        if not ranks:
            raise EngineNotReadyError("No engine core is ready.")
        loop = asyncio.get_running_loop()
        calls = {next(self._call_ids): rank for rank in ranks}
        futures = {}
        try:
            for call_id, rank in calls.items():
                futures[rank] = self._utility_calls[call_id] = (rank, loop.create_future())
                await self._send(rank, EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method))
            results = await asyncio.wait_for(
                asyncio.gather(*(f for _, f in futures.values())), _UTILITY_TIMEOUT_S
            )
        finally:
            for call_id in calls:
                self._utility_calls.pop(call_id, None)
        answers = dict(zip(futures, results, strict=True))
        failed = [f"rank {rank}: {r.error}" for rank, r in answers.items() if r.error is not None]
        if failed:
            raise RuntimeError(f"{method.value} failed on " + "; ".join(failed))
        return {rank: r.ok for rank, r in answers.items()}

    def _on_utility_result(self, rank: int, result: UtilityResult) -> None:
        pending = self._utility_calls.get(result.call_id)
        if pending is None or pending[0] != rank or pending[1].done():
            return  # a late answer to a call that timed out, or not ours
        pending[1].set_result(result)

    def _choose_rank(self, request: EngineCoreRequest) -> int:
        if request.data_parallel_rank is not None:
            rank = request.data_parallel_rank
            if rank not in self._stats:
                raise ValueError(f"data_parallel_rank must be in [0, {self.num_ranks}), got {rank}.")
            if self._stats[rank].state != "ready":
                raise EngineNotReadyError(f"Data-parallel rank {rank} is {self._stats[rank].state}.")
            return rank
        ready = [s for s in self._stats.values() if s.state == "ready"]
        if not ready:
            raise EngineNotReadyError("No engine core is ready.")
        if self.prefix_router is not None:
            return self.prefix_router.pick(
                request, {s.rank: 4 * s.num_waiting + s.num_running for s in ready}
            )
        # min() keeps the first of equal scores: ties go to the lowest rank.
        return min(ready, key=lambda s: (4 * s.num_waiting + s.num_running, s.rank)).rank

    async def _send(self, rank: int, kind: EngineCoreRequestType, payload: object = None) -> None:
        """Send to ``rank``; if its connection is gone, mark it dead (its
        requests, this one included, fail with ``EngineDeadError``)."""
        identity = self._identity.get(rank)
        if identity is None:
            return
        try:
            if payload is None:
                await self._input_sock.send_multipart([identity, kind.value])
            else:
                await asend(self._input_sock, self._encoder, payload, identity, kind.value)
        except zmq.ZMQError as e:
            if not is_unreachable(e):
                raise
            self._mark_dead(rank, "its connection is gone", quiet=True)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        rank = self._holder.pop(request_id, None)
        if rank is not None:
            self._stats[rank].in_flight.discard(request_id)

    def _finish_locally(self, request_id: str, item: EngineCoreOutput | BaseException) -> None:
        """Hand a request its last item and stop tracking it."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)
        self._forget(request_id)

    # ---- background tasks

    async def _recv(self, sock: zmq.asyncio.Socket, decoder: Decoder, num_header: int):
        """(header, message, the CURVE key name its connection used, None without CURVE)."""
        frames = await sock.recv_multipart(copy=False)
        header, body = split(frames, num_header)
        return header, decoder.decode(body), _key_name(frames[-1])

    async def _handshake_loop(self) -> None:
        decoder = Decoder(EngineHello)
        while True:
            try:
                frames = await self._handshake_sock.recv_multipart(copy=False)
                (identity,), body = split(frames, 1)
                hello = decoder.decode(body)
            except ValueError as e:
                self._dropped("handshake", e)
                continue
            rank = identity_rank(identity)
            if rank not in self._stats or hello.rank != rank:
                logger.warning("Ignored a hello from unknown rank %d (identity %r).", hello.rank, identity)
                continue
            state = self._stats[rank].state
            if self._closing:
                continue
            if state in _LIVE:
                # Another process already serves this rank: it keeps it.
                self._refuse_claim(rank, f"a hello for rank {rank}, which is {state}")
                continue
            if hello.local != (rank in self.local):
                logger.warning(
                    "Rank %d says local=%s, but this API %s start it.",
                    rank,
                    hello.local,
                    "did" if rank in self.local else "did not",
                )
            if state == "dead":
                self._stats[rank].state = "waiting"  # a restarted rank rejoins
                self._quiet.pop(rank, None)  # a new process: the old one's requests died with it
            # Bound until the rank dies: its ready and every later message must come from here.
            self._identity[rank] = identity
            self._key_name[rank] = _key_name(frames[-1])
            self._peer_host[rank] = _peer_host(frames[-1])  # where its KV events are subscribed to
            logger.info("Rank %d said hello (local=%s, headless=%s).", rank, hello.local, hello.headless)
            await asend(self._handshake_sock, self._encoder, self._reply_for(rank), identity)

    def _reply_for(self, rank: int) -> EngineHandshakeReply:
        parallel = msgspec.structs.replace(
            self.config.parallel, data_parallel_rank=rank, data_parallel_size=self.num_ranks
        )
        config = msgspec.structs.replace(self.config, parallel=parallel)
        return EngineHandshakeReply(
            config=config, input_address=self.input_address, output_address=self.output_address
        )

    async def _status_loop(self) -> None:
        decoder: Decoder[EngineStatus] = Decoder(EngineStatus)
        while True:
            try:
                (identity,), status, key_name = await self._recv(self._input_sock, decoder, 1)
            except ValueError as e:
                self._dropped("status", e)
                continue
            rank = identity_rank(identity)
            if rank not in self._stats or status.rank != rank:
                logger.warning("Ignored a status message from unknown rank %d.", status.rank)
                continue
            if identity != self._identity.get(rank) or key_name != self._key_name.get(rank):
                self._refuse_claim(rank, f"a {type(status).__name__} for rank {rank} from another connection")
                continue
            if isinstance(status, EngineReady):
                self._on_ready(status)
            elif isinstance(status, EngineDraining):
                await self._on_draining(status)
            elif isinstance(status, EngineGoodbye):
                self._quiet.pop(rank, None)  # it stops for good: nothing to rejoin
                why = status.reason or "no reason given"
                # One that never served says why it could not start; a serving one why it stopped.
                self._mark_dead(
                    rank, f"it stopped ({why})" if rank in self._ever_ready else why, expected=True
                )
                await self._send(rank, EngineCoreRequestType.SHUTDOWN)  # acknowledges the goodbye

    def _refuse_claim(self, rank: int, what: str) -> None:
        self._dropped_frames["rank_claim"] += 1
        if self._dropped_frames["rank_claim"] % 100 == 1:  # a peer retrying must not flood the log
            logger.warning(
                "Refused %s (%d refused so far): a rank is bound to the connection that shook hands for it.",
                what,
                self._dropped_frames["rank_claim"],
            )

    def _on_ready(self, ready: EngineReady) -> None:
        stats = self._stats[ready.rank]
        if stats.state != "waiting":
            return  # a late message of an instance declared dead
        stats.state = "ready"
        self._ever_ready.add(ready.rank)
        self._max_model_len[ready.rank] = ready.max_model_len
        self.local.on_ready(ready.rank)
        stats.num_blocks = ready.num_blocks
        stats.num_free_blocks = ready.num_blocks - 1  # block 0 is the null block
        self._last_seen[ready.rank] = time.monotonic()
        if self.prefix_router is not None:
            self._subscribe_events(ready.rank)
        logger.info(
            "Rank %d is ready (%d KV blocks, max_model_len %d).",
            ready.rank,
            ready.num_blocks,
            ready.max_model_len,
        )

    async def _on_draining(self, draining: EngineDraining) -> None:
        stats = self._stats[draining.rank]
        if stats.state != "ready":
            return
        stats.state = "draining"
        logger.info(
            "Rank %d is draining: it finishes its %d request(s) (at most %.0fs) and gets no new ones.",
            draining.rank,
            len(stats.in_flight),
            draining.timeout_s,
        )
        # Every ADD for this rank was sent before this: the engine may stop once idle.
        await self._send(draining.rank, EngineCoreRequestType.DRAIN)

    async def _output_loop(self) -> None:
        decoder = Decoder(EngineCoreOutputs)
        while True:
            try:
                (identity,), batch, key_name = await self._recv(self._output_sock, decoder, 1)
            except ValueError as e:
                self._dropped("output", e)
                continue
            stats = self._stats.get(batch.engine_index)
            if stats is None:
                continue
            if identity != self._identity.get(batch.engine_index) or key_name != self._key_name.get(
                batch.engine_index
            ):
                self._refuse_claim(
                    batch.engine_index, f"outputs for rank {batch.engine_index} from another connection"
                )
                continue
            stuck = self._stuck_step(batch)
            if batch.engine_index in self._quiet and stuck is None:
                await self._rejoin(batch.engine_index)
            if stats.state not in _LIVE:
                continue
            self._last_seen[batch.engine_index] = time.monotonic()
            if stuck is not None:
                # Its output thread still beats, but its busy loop is stuck in a step.
                self._mark_dead(batch.engine_index, stuck, hung=True, quiet=True)
                continue
            if batch.scheduler_stats is not None:
                _update_stats(stats, batch.scheduler_stats)
            if batch.utility_output is not None:
                self._on_utility_result(batch.engine_index, batch.utility_output)
            for output in batch.outputs:
                self._route(output)

    def _stuck_step(self, batch: EngineCoreOutputs) -> str | None:
        """Why ``batch``'s rank is hung (its current step ran past ``step_timeout_s``), or None."""
        stats = batch.scheduler_stats
        if stats is None or stats.step_elapsed_s <= self.step_timeout_s:
            return None
        return (
            f"it is hung: step {stats.step_counter + 1} has run for {stats.step_elapsed_s:.1f}s "
            f"(--step-timeout {self.step_timeout_s:g}s)"
        )

    async def _rejoin(self, rank: int) -> None:
        """A rank that went quiet is heard again: it serves again, after
        dropping the requests this client already failed."""
        stale = self._quiet.pop(rank)
        stats = self._stats[rank]
        stats.state = "ready"
        self._last_seen[rank] = time.monotonic()
        logger.warning(
            "Engine core rank %d is heard again: it rejoins (aborting its %d stale request(s)).",
            rank,
            len(stale),
        )
        if self.prefix_router is not None:
            self._subscribe_events(rank)  # its cache view is rebuilt from the replay
        if stale:
            await self._send(rank, EngineCoreRequestType.ABORT, sorted(stale))

    def _subscribe_events(self, rank: int) -> None:
        """The prefix router subscribes to the rank's KV events at the rank's own host and key."""
        assert self.prefix_router is not None
        self.prefix_router.rank_up(rank, host=self._peer_host.get(rank), key_name=self._key_name.get(rank))

    def _dropped(self, socket_name: str, error: Exception) -> None:
        self._dropped_frames[socket_name] += 1
        if self._dropped_frames[socket_name] % 100 == 1:  # garbage must not flood the log
            logger.warning(
                "Dropped a malformed %s message (%d so far): %s",
                socket_name,
                self._dropped_frames[socket_name],
                error,
            )

    def _route(self, output: EngineCoreOutput) -> None:
        queue = self._queues.get(output.request_id)
        if queue is None:
            return  # aborted here meanwhile
        if output.finished:
            self._finish_locally(output.request_id, output)
        else:
            queue.put_nowait(output)

    async def _monitor_loop(self) -> None:
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(_MONITOR_S)
            now = time.monotonic()
            for rank, stats in self._stats.items():
                code = self.local.exit_code(rank)
                if stats.state != "dead" and code is not None:
                    self._mark_dead(rank, f"its process exited with code {code}")
                elif stats.state in _LIVE and now - self._last_seen[rank] > self.silence_timeout_s:
                    self._mark_dead(
                        rank, f"it sent nothing for {self.silence_timeout_s:.1f}s", hung=True, quiet=True
                    )
            for rank in self.local.restart_due():
                self._stats[rank].state = "waiting"
            waiting = [r for r, s in self._stats.items() if s.state == "waiting"]
            if waiting and now - last_log > _WAITING_LOG_S:
                logger.info("Still waiting for engine core rank(s) %s to be ready.", waiting)
                last_log = now

    def _mark_dead(
        self, rank: int, reason: str, *, hung: bool = False, expected: bool = False, quiet: bool = False
    ) -> None:
        """``expected``: it said goodbye (a drain, a stop), rather than crashed or went silent.
        ``quiet``: it went silent or lost its connection; a remote rank may
        still be alive, and rejoins when heard again (a local one is killed)."""
        stats = self._stats[rank]
        if stats.state == "dead":
            return
        stats.state = "dead"
        if quiet and rank not in self.local and not self._closing:
            self._quiet[rank] = set(stats.in_flight)
        if self.prefix_router is not None:
            self.prefix_router.rank_down(rank)
        if not self._closing and rank in self.local and rank not in self._ever_ready:
            # It never served: a configuration or memory error, which a restart would only repeat.
            logger.error("Engine core rank %d failed to start: %s.", rank, reason)
            if self._start_failure is None:
                self._start_failure = f"engine core rank {rank} failed to start: {reason}"
            self.local.restart = False
            self.local.on_dead(rank, hung=hung)
        elif not self._closing:
            quiet_stop = expected and not stats.in_flight and rank in self._ever_ready
            level = logging.INFO if quiet_stop else logging.ERROR
            logger.log(
                level,
                "Engine core rank %d is dead: %s. Failing its %d in-flight request(s).",
                rank,
                reason,
                len(stats.in_flight),
            )
            self.local.on_dead(rank, hung=hung)
        for request_id in list(stats.in_flight):
            self._finish_locally(
                request_id,
                EngineDeadError(
                    f"Engine core rank {rank} stopped while serving request {request_id}: {reason}."
                ),
            )
        for held_by, future in self._utility_calls.values():
            if held_by == rank and not future.done():
                future.set_exception(EngineDeadError(f"Engine core rank {rank} stopped: {reason}."))
        stats.num_running = stats.num_waiting = 0


def _key_name(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id of a frame's connection: the CURVE key's name, None without CURVE."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


def _peer_host(frame: zmq.Frame) -> str | None:
    """The host a tcp connection came from (None for ipc, or when libzmq does not say)."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    return address or None


def _update_stats(stats: RankStats, new) -> None:
    stats.num_running = new.num_running_reqs
    stats.num_waiting = new.num_waiting_reqs
    stats.kv_cache_usage = new.kv_cache_usage
    stats.num_free_blocks = new.num_free_blocks
    add_deltas(stats, new)
    stats.num_dropped_frames = new.num_dropped_frames
    if new.structured_outputs is not None:  # totals, not deltas: keep the latest
        stats.structured_outputs = new.structured_outputs


def _log_task_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("Engine client task %s failed", task.get_name(), exc_info=task.exception())
