"""The engine core's KV event publisher: a PUB socket, a replay ROUTER, a ring buffer.

The engine's busy loop hands each step's events to ``publish`` (a queue put,
nothing more); one thread owns both sockets (ZMQ sockets are not
thread-safe), sends the batches in order and answers replay requests from
the last ``buffer_steps`` batches. The wire format is in
``protocol/kv_events.py``.

Both sockets come from the socket factory: CurveZMQ servers with a keys
folder (subscribers prove they hold the API's server key), a frame limit
fit for what a peer may send them (subscriptions, 8-byte replay requests),
bounded queues. Replays are rate-limited (``REPLAYS_PER_S``, burst
``REPLAY_BURST``; one over the rate gets an empty answer at once) and each
answer holds at most ``MAX_REPLAY_BATCHES`` batches and ``MAX_REPLAY_BYTES``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from protocol.curve import CLIENT, SERVER, CurveKeys, ZapAuthenticator, load_keys
from protocol.kv_events import (
    END_OF_REPLAY,
    KVCacheEvent,
    KVEventBatch,
    KVEventsConfig,
    check_endpoints,
    endpoint_for_rank,
    seq_bytes,
    seq_from,
)
from protocol.zmq_sockets import bound_address, make_socket

logger = logging.getLogger(__name__)

_POLL_MS = 20  # the thread's longest wait on the replay socket between batches
# What a peer may send: a subscription (1 byte + topic) to the PUB, an 8-byte seq to the replay;
# 1 KiB leaves room for the CURVE handshake's commands, which the frame limit counts too.
MAX_SUBSCRIPTION_BYTES = 1024
MAX_REPLAY_REQUEST_BYTES = 1024
REPLAYS_PER_S = 4.0
REPLAY_BURST = 8
MAX_REPLAY_BATCHES = 1000
MAX_REPLAY_BYTES = 8 << 20
_REPLAY_HWM = 2 * (MAX_REPLAY_BATCHES + 1)  # two answers queued per peer; past that the ROUTER drops


def event_server_keys(keys_dir: str) -> CurveKeys:
    """The engine's own keypair (the client key of a `weft keys` folder, or its node key) as a
    CURVE server that lets in the holder of the folder's server key (the API)."""
    own = load_keys(keys_dir, CLIENT)
    return CurveKeys(SERVER, own.public, own.secret, own.peer_public)


class _TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.last = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, rank: int, ctx: zmq.SyncContext | None = None) -> None:
        self.topic = config.topic.encode()
        self.rank = rank
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._num_dropped = 0
        self.num_replays_refused = 0  # over the rate, or malformed
        self._replay_bucket = _TokenBucket(REPLAYS_PER_S, REPLAY_BURST)
        curve = None if config.keys_dir is None else event_server_keys(config.keys_dir)
        # Before any socket binds: no peer is let in unchecked.
        self.auth = ZapAuthenticator(self._ctx, curve) if curve is not None else None
        self._pub = make_socket(
            self._ctx,
            zmq.PUB,
            endpoint_for_rank(config.endpoint, rank),
            bind=True,
            curve=curve,
            max_msg_size=MAX_SUBSCRIPTION_BYTES,
            hwm=config.hwm,
        )
        self.endpoint = bound_address(self._pub)
        self._replay: zmq.SyncSocket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = make_socket(
                self._ctx,
                zmq.ROUTER,
                endpoint_for_rank(config.replay_endpoint, rank),
                bind=True,
                curve=curve,
                max_msg_size=MAX_REPLAY_REQUEST_BYTES,
                hwm=_REPLAY_HWM,
            )
            self.replay_endpoint = bound_address(self._replay)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "Rank %d publishes KV cache events on %s (replay: %s).",
            rank,
            self.endpoint,
            self.replay_endpoint or "off",
        )

    @property
    def num_sent(self) -> int:
        """Batches sent so far (each also kept for replay, while the buffer holds it)."""
        return self._next_seq

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as a batch; a full queue drops it (counted, logged)."""
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank))
        except queue.Full:
            self._num_dropped += 1
            if self._num_dropped % 100 == 1:
                logger.warning("KV event queue full: dropped %d batch(es) so far.", self._num_dropped)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (bounded), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event thread of rank %d did not stop in %.1fs.", self.rank, timeout_s)
            return  # it still owns the sockets
        self._close_sockets()

    # ---- the publisher thread

    def _run(self) -> None:
        # One plain msgpack frame per batch: any msgspec (or msgpack) subscriber reads it.
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                try:
                    batch = self._queue.get(timeout=_POLL_MS / 1000 if self._replay is not None else None)
                except queue.Empty:
                    pass  # no batch this time: serve the replay requests
                else:
                    if batch is None:
                        return
                    self._send(encoder, batch)
                self._serve_replays()
        except zmq.ContextTerminated:
            return
        except Exception:
            logger.exception("KV event publisher of rank %d failed; no more events are sent.", self.rank)

    def _send(self, encoder: msgspec.msgpack.Encoder, batch: KVEventBatch) -> None:
        payload = encoder.encode(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart([self.topic, seq_bytes(seq), payload])

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            identity, body = frames[0], frames[1:]
            if body and body[0] == b"":
                envelope, body = [identity, b""], body[1:]
            else:
                envelope = [identity]
            try:
                start = seq_from(body[0]) if len(body) == 1 else None
            except ValueError:
                start = None
            if start is None or not self._replay_bucket.take():
                self.num_replays_refused += 1
                if self.num_replays_refused % 100 == 1:
                    logger.warning(
                        "Rank %d refused a KV event replay request (malformed or over %.0f/s; %d so far).",
                        self.rank,
                        REPLAYS_PER_S,
                        self.num_replays_refused,
                    )
                if start is not None:  # over the rate: an empty answer, so the peer does not wait
                    self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])
                continue
            num_batches = num_bytes = 0
            for seq, payload in self._buffer:
                if seq < start:
                    continue
                num_batches += 1
                num_bytes += len(payload)
                if num_batches > MAX_REPLAY_BATCHES or num_bytes > MAX_REPLAY_BYTES:
                    break  # the rest in a later replay
                self._replay.send_multipart([*envelope, seq_bytes(seq), payload])
            self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        if self.auth is not None:
            self.auth.stop()
        if self._own_ctx:
            self._ctx.term()


def make_publisher(config: KVEventsConfig | None, rank: int) -> ZmqEventPublisher | None:
    if config is None or not config.publishes:
        return None
    check_endpoints(config, 1, has_keys=False)  # an exposed endpoint needs keys_dir by now
    return ZmqEventPublisher(config, rank)


def with_default_keys_dir(config: KVEventsConfig | None, curve_keys: str | None) -> KVEventsConfig | None:
    """``config`` whose sockets use the engine's ``--zmq-curve-keys`` folder unless it names its own."""
    if config is None or curve_keys is None or config.keys_dir is not None:
        return config
    return msgspec.structs.replace(config, keys_dir=str(curve_keys))
