"""RankMembership: which engine core serves each data-parallel rank, and in what state.

It binds the API's three engine sockets (engines connect):

- handshake ROUTER: answers each engine's hello with its config and the
  data addresses;
- input ROUTER: requests out (``send``), addressed by rank identity;
  engines' ready, draining and goodbye messages in;
- output ROUTER: ``EngineCoreOutputs`` from every rank (outputs, load stats,
  heartbeats), each taken only from the identity bound to its rank; what a
  live rank sends is handed to the ``RankListener`` (the request client,
  ``services/api/dp_client.py``).

With ``curve`` keys every socket is a CurveZMQ server and only engines
holding the client key get in (``protocol.curve``); a frame that does not
decode is counted (``dropped_frames()``) and dropped.

A rank's life: ``waiting`` (until its hello and ready) -> ``ready`` ->
``draining`` (it was told to stop: it finishes what it holds, gets nothing
new) -> ``dead`` (its process exited, it said goodbye, it was silent for
``silence_timeout_s``, or it is hung: its heartbeat says one step has run
past ``step_timeout_s``, ``--step-timeout``): the listener then fails its
in-flight requests, and a local one is killed and restarted. A dead rank
that says hello again (a local one restarted by ``LocalEngines``, a headless
one restarted by the operator) is handed its config and rejoins once ready;
a headless rank that was only silent (a network blip, a long stall) rejoins
as soon as it is heard again, and is told to abort what it held (a hung one
once its heartbeat shows it left the stuck step).

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
traffic, nor say goodbye or draining for it. Outputs, stats and heartbeats
for a rank from any other connection are refused and counted too, so a
peer cannot keep a hung rank "ready" or forge its results, CURVE or not.
With CURVE the rank is also bound to the key its hello came with
(``client`` or a per-node key, see ``protocol.curve``): status messages and
outputs for it must come over connections authenticated with that key, so
one node cannot speak for a rank another node serves. The input ROUTER is
ROUTER_MANDATORY: a send to a rank whose connection is gone marks the rank
dead at once instead of vanishing.

The message handlers (``on_hello``, ``on_status``, ``accept_outputs``,
``check_ranks``) hold the whole state machine; the socket loops only
receive, decode and answer. Torch-free: nothing here may import torch.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, Protocol, TypeVar, cast

import msgspec
import zmq
import zmq.asyncio

from protocol import EngineConfig, EngineCoreOutputs, EngineCoreRequestType, SchedulerStats
from protocol.codec import Decoder, Encoder
from protocol.curve import CurveKeys, ZapAuthenticator
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
from services.api.engine_client import DEFAULT_STEP_TIMEOUT_S, RankStats, add_deltas
from services.api.engine_processes import LocalEngines
from services.api.prefix_router import PrefixRouter

__all__ = ["LIVE", "RankListener", "RankMembership"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MONITOR_S = 0.2
_WAITING_LOG_S = 5.0
_SHUTDOWN_WAIT_S = 5.0
# Ranks that serve requests (ready) or finish the ones they hold (draining).
LIVE = ("ready", "draining")


class RankListener(Protocol):
    """What the request client hears from the membership."""

    def on_outputs(self, batch: EngineCoreOutputs) -> None:
        """A live rank's batch, its load stats already taken: route its outputs and utility answer."""

    def on_rank_dead(self, rank: int, reason: str) -> None:
        """``rank`` just died: fail what it held (its ``RankStats.in_flight``, its utility calls)."""


class RankMembership:
    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        num_ranks: int,
        listener: RankListener,
        local_processes: Sequence[subprocess.Popen[bytes]] = (),
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
        with ``restart_local`` one that dies is started again (with back-off). A ``prefix_router``
        is told which ranks are up, to follow their KV events. ``data_ports``: the input and
        output sockets' TCP ports when the handshake is TCP (0: any free port)."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be at least 1, got {num_ranks}.")
        if not 0 <= local_start_rank <= local_start_rank + len(local_processes) <= num_ranks:
            raise ValueError(
                f"Local ranks {local_start_rank}..{local_start_rank + len(local_processes) - 1} "
                f"do not fit in {num_ranks} ranks."
            )
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be positive, got {step_timeout_s}.")
        self.config = config
        self.handshake_address = handshake_address
        self.input_address = ""  # the bound addresses, known once started
        self.output_address = ""
        self.num_ranks = num_ranks
        self.listener = listener
        self.silence_timeout_s = silence_timeout_s
        self.step_timeout_s = step_timeout_s
        self.curve = curve
        self.prefix_router = prefix_router
        self.data_ports = {"input": data_ports[0], "output": data_ports[1]}
        self.local = LocalEngines(
            dict(enumerate(local_processes, start=local_start_rank)), restart=restart_local
        )
        self.stats = {rank: RankStats(rank=rank) for rank in range(num_ranks)}
        self.peer_host: dict[int, str | None] = {}  # rank -> its handshake's tcp peer host (None: ipc)
        self._last_seen: dict[int, float] = {}
        self._identity: dict[int, bytes] = {}  # rank -> the identity that shook hands for it
        self._key_name: dict[int, str | None] = {}  # rank -> the CURVE key its hello came with
        # Ranks dead because they went quiet (or their connection dropped),
        # and the requests they held: heard again, they rejoin and abort those.
        self._quiet: dict[int, set[str]] = {}
        # Each rank's context as it reported it when ready (it may have lowered the config's).
        self._max_model_len: dict[int, int] = {}
        self._ever_ready: set[int] = set()
        self._start_failure: str | None = None
        # Frames that failed to decode, by the socket they came in on, and refused rank claims.
        self._dropped_frames = {"handshake": 0, "status": 0, "output": 0, "rank_claim": 0}
        self._encoder = Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: ZapAuthenticator | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # ---- what the API reads

    @property
    def ready(self) -> bool:
        return all(s.state == "ready" for s in self.stats.values())

    def live_ranks(self) -> list[int]:
        return [rank for rank, s in self.stats.items() if s.state in LIVE]

    def dropped_frames(self) -> dict[str, int]:
        return dict(self._dropped_frames)

    @property
    def max_model_len(self) -> int | None:
        # The shortest: a request may go to any rank.
        return min(self._max_model_len.values(), default=None)

    @property
    def start_failure(self) -> str | None:
        return self._start_failure

    # ---- sockets

    async def start(self) -> None:
        if self._ctx is not None:
            raise RuntimeError("DPLBEngineClient.start() was already called.")
        self._ctx = ctx = zmq.asyncio.Context()
        if self.curve is not None:
            self._auth = ZapAuthenticator(ctx, self.curve)  # before any socket accepts a peer
        self._handshake_sock = self._bind(ctx, zmq.ROUTER, self.handshake_address)
        self.handshake_address = bound_address(self._handshake_sock)
        self._input_sock = self._bind(
            ctx, zmq.ROUTER, self._data_address("input"), linger=1000, router_mandatory=True
        )
        self._output_sock = self._bind(ctx, zmq.ROUTER, self._data_address("output"))
        self.input_address = bound_address(self._input_sock)
        self.output_address = bound_address(self._output_sock)
        if self.prefix_router is not None:
            self.prefix_router.start(ctx, self.curve)
        loops: dict[str, Coroutine[Any, Any, None]] = {
            "_handshake_loop": self._handshake_loop(),
            "_status_loop": self._status_loop(),
            "_output_loop": self._output_loop(),
            "_monitor_loop": self._monitor_loop(),
        }
        for name, coro in loops.items():
            task = asyncio.create_task(coro, name=name)
            task.add_done_callback(_log_task_failure)
            self._tasks.append(task)

    def _bind(
        self,
        ctx: zmq.asyncio.Context,
        socket_type: int,
        address: str,
        linger: int = 0,
        router_mandatory: bool = False,
    ) -> zmq.asyncio.Socket:
        sock = make_socket(
            ctx,
            socket_type,
            address,
            bind=True,
            linger=linger,
            curve=self.curve,
            router_mandatory=router_mandatory,
        )
        return sock

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
        live = self.live_ranks()
        for rank in live:
            await self.send(rank, EngineCoreRequestType.SHUTDOWN)
        # Each live rank answers with its goodbye (handled by _status_loop).
        deadline = time.monotonic() + _SHUTDOWN_WAIT_S
        while time.monotonic() < deadline and any(self.stats[r].state != "dead" for r in live):
            await asyncio.sleep(_MONITOR_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.prefix_router is not None:
            await self.prefix_router.stop()
        for rank in list(self.stats):
            self.mark_dead(rank, "the API shut down")
        # Engines that said goodbye are exiting: let them, before any SIGTERM.
        await asyncio.to_thread(self.local.stop, exit_wait_s=_SHUTDOWN_WAIT_S)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)

    async def send(self, rank: int, kind: EngineCoreRequestType, payload: object = None) -> None:
        """Send to ``rank``; if its connection is gone, mark it dead (its
        requests, one just sent included, fail with ``EngineDeadError``)."""
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
            self.mark_dead(rank, "its connection is gone", quiet=True)

    async def _messages(
        self, sock: zmq.asyncio.Socket, decoder: Decoder[T], name: str
    ) -> AsyncIterator[tuple[bytes, T, zmq.Frame]]:
        """Forever, (the sender's identity, the message, its last frame: the connection's
        properties); a message that does not decode is counted (``_dropped``) and skipped."""
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                (identity,), body = split(frames, 1)
                message = decoder.decode(body)
            except ValueError as e:
                self._dropped(name, e)
                continue
            yield identity, message, frames[-1]

    async def _handshake_loop(self) -> None:
        hellos = self._messages(self._handshake_sock, Decoder(EngineHello), "handshake")
        async for identity, hello, frame in hellos:
            if self.on_hello(identity, hello, _key_name(frame), _peer_host(frame)):
                await asend(self._handshake_sock, self._encoder, self.reply_for(hello.rank), identity)

    async def _status_loop(self) -> None:
        decoder: Decoder[EngineStatus] = Decoder(cast(Any, EngineStatus))
        async for identity, status, frame in self._messages(self._input_sock, decoder, "status"):
            await self.on_status(identity, status, _key_name(frame))

    async def _output_loop(self) -> None:
        batches = self._messages(self._output_sock, Decoder(EngineCoreOutputs), "output")
        async for identity, batch, frame in batches:
            if await self.accept_outputs(identity, batch, _key_name(frame)):
                self.listener.on_outputs(batch)

    async def _monitor_loop(self) -> None:
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(_MONITOR_S)
            now = time.monotonic()
            self.check_ranks(now)
            waiting = [r for r, s in self.stats.items() if s.state == "waiting"]
            if waiting and now - last_log > _WAITING_LOG_S:
                logger.info("Still waiting for engine core rank(s) %s to be ready.", waiting)
                last_log = now

    # ---- the state machine, one handler per message

    def on_hello(
        self, identity: bytes, hello: EngineHello, key_name: str | None, peer_host: str | None
    ) -> bool:
        """Bind the hello's rank to ``identity`` (and its key and host); False when refused."""
        rank = identity_rank(identity)
        if rank not in self.stats or hello.rank != rank:
            logger.warning("Ignored a hello from unknown rank %d (identity %r).", hello.rank, identity)
            return False
        state = self.stats[rank].state
        if self._closing:
            return False
        if state in LIVE:
            # Another process already serves this rank: it keeps it.
            self._refuse_claim(rank, f"a hello for rank {rank}, which is {state}")
            return False
        if hello.local != (rank in self.local):
            logger.warning(
                "Rank %d says local=%s, but this API %s start it.",
                rank,
                hello.local,
                "did" if rank in self.local else "did not",
            )
        if state == "dead":
            self.stats[rank].state = "waiting"  # a restarted rank rejoins
            self._quiet.pop(rank, None)  # a new process: the old one's requests died with it
        # Bound until the rank dies: its ready and every later message must come from here.
        self._identity[rank] = identity
        self._key_name[rank] = key_name
        self.peer_host[rank] = peer_host  # where its KV events are subscribed to
        logger.info("Rank %d said hello (local=%s, headless=%s).", rank, hello.local, hello.headless)
        return True

    def reply_for(self, rank: int) -> EngineHandshakeReply:
        parallel = msgspec.structs.replace(
            self.config.parallel, data_parallel_rank=rank, data_parallel_size=self.num_ranks
        )
        config = msgspec.structs.replace(self.config, parallel=parallel)
        return EngineHandshakeReply(
            config=config, input_address=self.input_address, output_address=self.output_address
        )

    async def on_status(self, identity: bytes, status: EngineStatus, key_name: str | None) -> None:
        """A ready, draining or goodbye message on the input socket."""
        rank = identity_rank(identity)
        if rank not in self.stats or status.rank != rank:
            logger.warning("Ignored a status message from unknown rank %d.", status.rank)
            return
        if not self._bound_to(rank, identity, key_name):
            self._refuse_claim(rank, f"a {type(status).__name__} for rank {rank} from another connection")
            return
        if isinstance(status, EngineReady):
            self._on_ready(status)
        elif isinstance(status, EngineDraining):
            await self._on_draining(status)
        elif isinstance(status, EngineGoodbye):
            self._quiet.pop(rank, None)  # it stops for good: nothing to rejoin
            why = status.reason or "no reason given"
            # One that never served says why it could not start; a serving one why it stopped.
            self.mark_dead(rank, f"it stopped ({why})" if rank in self._ever_ready else why, expected=True)
            await self.send(rank, EngineCoreRequestType.SHUTDOWN)  # acknowledges the goodbye

    def _bound_to(self, rank: int, identity: bytes, key_name: str | None) -> bool:
        return identity == self._identity.get(rank) and key_name == self._key_name.get(rank)

    def _on_ready(self, ready: EngineReady) -> None:
        stats = self.stats[ready.rank]
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
        stats = self.stats[draining.rank]
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
        await self.send(draining.rank, EngineCoreRequestType.DRAIN)

    async def accept_outputs(self, identity: bytes, batch: EngineCoreOutputs, key_name: str | None) -> bool:
        """Take a batch's heartbeat and load stats; True when its outputs are to be routed
        (it came from the rank's own connection and the rank is live and not hung)."""
        rank = batch.engine_index
        stats = self.stats.get(rank)
        if stats is None:
            return False
        if not self._bound_to(rank, identity, key_name):
            self._refuse_claim(rank, f"outputs for rank {rank} from another connection")
            return False
        stuck = self.stuck_step(batch)
        if rank in self._quiet and stuck is None:
            await self._rejoin(rank)
        if stats.state not in LIVE:
            return False
        self._last_seen[rank] = time.monotonic()
        if stuck is not None:
            # Its output thread still beats, but its busy loop is stuck in a step.
            self.mark_dead(rank, stuck, hung=True, quiet=True)
            return False
        if batch.scheduler_stats is not None:
            _update_stats(stats, batch.scheduler_stats)
        return True

    def stuck_step(self, batch: EngineCoreOutputs) -> str | None:
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
        dropping the requests the listener already failed."""
        stale = self._quiet.pop(rank)
        stats = self.stats[rank]
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
            await self.send(rank, EngineCoreRequestType.ABORT, sorted(stale))

    def check_ranks(self, now: float) -> None:
        """The monitor's round at ``now`` (monotonic): ranks whose process exited or that went
        silent die; local ones whose restart is due wait for their new process."""
        for rank, stats in self.stats.items():
            code = self.local.exit_code(rank)
            if stats.state != "dead" and code is not None:
                self.mark_dead(rank, f"its process exited with code {code}")
            elif stats.state in LIVE and now - self._last_seen[rank] > self.silence_timeout_s:
                self.mark_dead(
                    rank, f"it sent nothing for {self.silence_timeout_s:.1f}s", hung=True, quiet=True
                )
        for rank in self.local.restart_due():
            self.stats[rank].state = "waiting"

    def mark_dead(
        self, rank: int, reason: str, *, hung: bool = False, expected: bool = False, quiet: bool = False
    ) -> None:
        """``expected``: it said goodbye (a drain, a stop), rather than crashed or went silent.
        ``quiet``: it went silent or lost its connection; a remote rank may
        still be alive, and rejoins when heard again (a local one is killed)."""
        stats = self.stats[rank]
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
        self.listener.on_rank_dead(rank, reason)
        stats.num_running = stats.num_waiting = 0

    def _subscribe_events(self, rank: int) -> None:
        """The prefix router subscribes to the rank's KV events at the rank's own host and key."""
        assert self.prefix_router is not None
        self.prefix_router.rank_up(rank, host=self.peer_host.get(rank), key_name=self._key_name.get(rank))

    def _refuse_claim(self, rank: int, what: str) -> None:
        self._dropped_frames["rank_claim"] += 1
        if self._dropped_frames["rank_claim"] % 100 == 1:  # a peer retrying must not flood the log
            logger.warning(
                "Refused %s (%d refused so far): a rank is bound to the connection that shook hands for it.",
                what,
                self._dropped_frames["rank_claim"],
            )

    def _dropped(self, socket_name: str, error: Exception) -> None:
        self._dropped_frames[socket_name] += 1
        if self._dropped_frames[socket_name] % 100 == 1:  # garbage must not flood the log
            logger.warning(
                "Dropped a malformed %s message (%d so far): %s",
                socket_name,
                self._dropped_frames[socket_name],
                error,
            )


def _key_name(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id of a frame's connection: the CURVE key's name, None without CURVE."""
    try:
        name = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return name if isinstance(name, str) else None


def _peer_host(frame: zmq.Frame) -> str | None:
    """The host a tcp connection came from (None for ipc, or when libzmq does not say)."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    return address if isinstance(address, str) and address else None


def _update_stats(stats: RankStats, new: SchedulerStats) -> None:
    stats.num_running = new.num_running_reqs
    stats.num_waiting = new.num_waiting_reqs
    stats.kv_cache_usage = new.kv_cache_usage
    stats.num_free_blocks = new.num_free_blocks
    add_deltas(stats, new)
    stats.num_dropped_frames = new.num_dropped_frames
    if new.structured_outputs is not None:  # totals, not deltas: keep the latest
        stats.structured_outputs = new.structured_outputs


def _log_task_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("Engine client task %s failed", task.get_name(), exc_info=task.exception())
