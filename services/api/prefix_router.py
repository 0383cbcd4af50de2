"""Prefix-cache-aware choice of a data-parallel rank, fed by the ranks' KV cache events.

Each rank's events (``protocol/kv_events.py``) build a ``RankCacheView``: the
set of block hashes the rank holds, hashes only, at most ``max_hashes`` of
them (beyond that the oldest are forgotten: a view is a hint, never a
promise). A rank that dies loses its view; when it is ready again, a fresh
subscriber rebuilds the view, first from the rank's replay socket.

The rule (``choose_rank``), with load = ``4 * waiting + running`` as the
load-only balancer counts it:

1. Only ranks within ``max_imbalance`` load units of the least loaded one
   are candidates, so one hot prefix cannot pile every request on one rank
   while another idles: past the bound, the hit no longer pays for the wait.
2. Among candidates, the longest cached prefix of the prompt (in full
   blocks, hashed as the engine hashes them: block size, cache salt, same
   hash chain) wins; ties go to the lower load, then the lower rank.
3. With no hit anywhere, a request with a session key (the ``x-session-id``
   header or the OpenAI ``user`` field) goes to the candidate that
   rendezvous (highest-random-weight) hashing gives its key, so a session
   stays on one rank as long as loads allow and ranks joining or leaving
   move only the sessions they must.
4. Otherwise the least loaded candidate (the load-only rule).

Knobs: ``--dp-routing prefix|load`` and ``--dp-prefix-max-imbalance``.

Each rank is subscribed to at its own address (a remote rank's host, as its
handshake connection showed it, in place of a wildcard bind), and with
``--zmq-curve-keys`` as a CurveZMQ client holding the API's server key,
talking only to the key the rank shook hands with.
Torch-free: nothing here may import torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable, Mapping

import msgspec
import zmq
import zmq.asyncio

from protocol import EngineConfig, EngineCoreRequest
from protocol.block_hashes import prompt_block_hashes
from protocol.curve import CLIENT, SERVER, CurveKeys, load_keys
from protocol.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    connect_address,
    endpoint_for_rank,
    seq_bytes,
    seq_from,
)
from protocol.zmq_sockets import make_socket

logger = logging.getLogger(__name__)

DEFAULT_MAX_IMBALANCE = 8  # load units: two waiting requests
DEFAULT_MAX_HASHES = 1 << 18  # per rank: 256 Ki hashes, about 16 MiB with the dict's overhead
MAX_SESSION_KEY_CHARS = 256
_REPLAY_TIMEOUT_S = 2.0
# Largest event message read; a bigger one (a broken or hostile peer) drops the link's frame, not our memory.
MAX_EVENT_MESSAGE_BYTES = 64 << 20
ROUTING_MODES = ("prefix", "load")


class RankCacheView:
    """The block hashes one rank caches, as its events tell."""

    def __init__(self, max_hashes: int = DEFAULT_MAX_HASHES) -> None:
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be at least 1, got {max_hashes}.")
        self.max_hashes = max_hashes
        self._hashes: dict[bytes, None] = {}  # insertion-ordered: the oldest go first past the cap

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._hashes

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._hashes[block_hash] = None
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._hashes.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                self._hashes.clear()
        while len(self._hashes) > self.max_hashes:
            del self._hashes[next(iter(self._hashes))]

    def clear(self) -> None:
        self._hashes.clear()

    def hit_blocks(self, block_hashes: Iterable[bytes]) -> int:
        """How many leading blocks are cached (hashes chain: the first miss ends the prefix)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            count += 1
        return count


def choose_rank(
    loads: Mapping[int, int],
    hits: Mapping[int, int],
    session_key: str | None = None,
    max_imbalance: int = DEFAULT_MAX_IMBALANCE,
) -> int:
    """The rule in the module docstring; ``loads`` holds the ready ranks, ``hits`` their hit blocks."""
    if not loads:
        raise ValueError("no rank to choose from")
    least = min(loads.values())
    candidates = sorted(rank for rank, load in loads.items() if load <= least + max_imbalance)
    best_hit = max(hits.get(rank, 0) for rank in candidates)
    if best_hit > 0:
        return min((r for r in candidates if hits.get(r, 0) == best_hit), key=lambda r: (loads[r], r))
    if session_key is not None:
        return max(candidates, key=lambda r: _rendezvous_weight(session_key, r))
    return min(candidates, key=lambda r: (loads[r], r))


def _rendezvous_weight(key: str, rank: int) -> bytes:
    return hashlib.sha256(f"{rank}\0{key}".encode()).digest()


def session_key_of(header: str | None, user: str | None) -> str | None:
    """The request's session key: ``x-session-id`` first, then ``user``; ValueError when too long."""
    key = header if header else user
    if key is not None and len(key) > MAX_SESSION_KEY_CHARS:
        raise ValueError(
            f"the session key (x-session-id or user) is longer than {MAX_SESSION_KEY_CHARS} characters."
        )
    return key or None


class RankSubscriber:
    """One rank's events into its view: a SUB socket, and the replay socket for gaps."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        config: KVEventsConfig,
        rank: int,
        view: RankCacheView,
        host: str = "127.0.0.1",
        curve: CurveKeys | None = None,
    ) -> None:
        self.rank = rank
        self._curve = curve
        self.view = view
        self.next_seq = 0
        self.num_replays = 0
        self.num_dropped = 0  # frames that did not decode
        self._ctx = ctx
        self._topic = config.topic.encode()
        self._address = connect_address(endpoint_for_rank(config.endpoint, rank), host)
        self._replay_address = (
            None
            if config.replay_endpoint is None
            else connect_address(endpoint_for_rank(config.replay_endpoint, rank), host)
        )
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)

    async def run(self) -> None:
        sub = self._connect(zmq.SUB, self._address)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        try:
            await self._replay()  # whatever was published before this subscriber connected
            while True:
                frames = await sub.recv_multipart()
                await self._on_message(frames)
        finally:
            sub.close()

    def _connect(self, kind: int, address: str) -> zmq.asyncio.Socket:
        return make_socket(
            self._ctx, kind, address, bind=False, curve=self._curve, max_msg_size=MAX_EVENT_MESSAGE_BYTES
        )

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.num_dropped += 1
            return
        seq = self._seq(frames[1])
        if seq is None:
            return
        if seq > self.next_seq:
            await self._replay()  # missed batches: catch up before applying this one
        if seq >= self.next_seq:
            self._apply(seq, frames[2])

    def _seq(self, frame: bytes) -> int | None:
        """A batch's sequence number; None (the batch dropped) when the frame is not one."""
        try:
            return seq_from(frame)
        except ValueError:
            self.num_dropped += 1
            return None

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError:
            self.num_dropped += 1
            return
        self.view.apply(batch)
        self.next_seq = seq + 1

    async def _replay(self) -> None:
        """Ask for the batches from ``next_seq`` on; bounded in time (a hint may stay incomplete)."""
        if self._replay_address is None:
            return
        self.num_replays += 1
        sock = self._connect(zmq.DEALER, self._replay_address)
        try:
            await sock.send_multipart([b"", seq_bytes(self.next_seq)])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _REPLAY_TIMEOUT_S
            while (left := deadline - loop.time()) > 0 and await sock.poll(int(left * 1000) + 1):
                frames = await sock.recv_multipart()
                if len(frames) != 3 or frames[1] == END_OF_REPLAY:
                    return
                seq = self._seq(frames[1])
                if seq is None:
                    return
                if seq >= self.next_seq:
                    self._apply(seq, frames[2])
            logger.warning("Rank %d's KV event replay did not finish in %.0fs.", self.rank, _REPLAY_TIMEOUT_S)
        finally:
            sock.close()


class PrefixRouter:
    """Per-rank views kept current by subscribers; ``pick`` applies ``choose_rank``."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        max_imbalance: int = DEFAULT_MAX_IMBALANCE,
        max_hashes: int = DEFAULT_MAX_HASHES,
        host: str = "127.0.0.1",
    ) -> None:
        if config.kv_events is None or not config.kv_events.publishes:
            raise ValueError(
                "--dp-routing prefix needs KV cache events: --kv-events-config "
                '\'{"enable_kv_cache_events": true, "publisher": "zmq", ...}\'.'
            )
        if max_imbalance < 0:
            raise ValueError(f"--dp-prefix-max-imbalance must be non-negative, got {max_imbalance}.")
        self.events_config = config.kv_events
        self.block_size = config.cache.block_size
        self.max_imbalance = max_imbalance
        self.max_hashes = max_hashes
        self.host = host
        self.views: dict[int, RankCacheView] = {}
        self.subscribers: dict[int, RankSubscriber] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._curve: CurveKeys | None = None

    def start(self, ctx: zmq.asyncio.Context, curve: CurveKeys | None = None) -> None:
        """``curve``: the API's server keys (``--zmq-curve-keys``), which the ranks' event sockets let
        in; without them, those of the events' own ``keys_dir``, when it names one."""
        self._ctx = ctx
        if curve is None and self.events_config.keys_dir is not None:
            curve = load_keys(self.events_config.keys_dir, SERVER)
        self._curve = curve

    def rank_up(self, rank: int, *, host: str | None = None, key_name: str | None = None) -> None:
        """A rank became ready: a fresh view, rebuilt from its events (replay first).
        ``host``: where the rank's connection came from (None: this node); ``key_name``: the
        CURVE key it shook hands with (``client`` or ``node-NAME``)."""
        self.rank_down(rank)
        if self._ctx is None:
            return
        view = self.views[rank] = RankCacheView(self.max_hashes)
        subscriber = self.subscribers[rank] = RankSubscriber(
            self._ctx, self.events_config, rank, view, host or self.host, self._subscriber_keys(key_name)
        )
        task = asyncio.get_running_loop().create_task(subscriber.run(), name=f"kv-events-{rank}")
        task.add_done_callback(_log_failure)
        self._tasks[rank] = task

    def _subscriber_keys(self, key_name: str | None) -> CurveKeys | None:
        """The API's server keypair as a CURVE client of the rank's own key."""
        curve = self._curve
        if curve is None:
            return None
        by_name = {name: public for public, name in curve.node_keys.items()}
        peer = by_name.get(key_name or "", curve.peer_public)
        return CurveKeys(CLIENT, curve.public, curve.secret, peer)

    def rank_down(self, rank: int) -> None:
        """A rank died or restarts: what it cached is gone with it."""
        task = self._tasks.pop(rank, None)
        if task is not None:
            task.cancel()
        self.views.pop(rank, None)
        self.subscribers.pop(rank, None)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for rank in list(self._tasks):
            self.rank_down(rank)
        await asyncio.gather(*tasks, return_exceptions=True)

    def pick(self, request: EngineCoreRequest, loads: Mapping[int, int]) -> int:
        hashes = prompt_block_hashes(
            request.prompt_token_ids,
            self.block_size,
            request.cache_salt,
            max_blocks=(len(request.prompt_token_ids) - 1) // self.block_size,
        )
        hits = {rank: view.hit_blocks(hashes) for rank, view in self.views.items() if rank in loads}
        return choose_rank(loads, hits, request.session_key, self.max_imbalance)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("KV event subscriber %s failed", task.get_name(), exc_info=task.exception())
