"""The engine core's KV event publisher: a PUB socket, a replay ROUTER, a ring buffer.

The engine's busy loop hands each step's events to ``publish`` (a queue put,
nothing more); one thread owns both sockets (ZMQ sockets are not
thread-safe), sends the batches in order and answers replay requests from
the last ``buffer_steps`` batches. The wire format is in
``protocol/kv_events.py``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from protocol.kv_events import (
    END_OF_REPLAY,
    KVCacheEvent,
    KVEventBatch,
    KVEventsConfig,
    endpoint_for_rank,
    seq_bytes,
    seq_from,
)
from services.config.json_arg import parse_json_object

logger = logging.getLogger(__name__)

_POLL_MS = 20  # the thread's longest wait on the replay socket between batches


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, rank: int, ctx: zmq.Context | None = None) -> None:
        self.topic = config.topic.encode()
        self.rank = rank
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._num_dropped = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, endpoint_for_rank(config.endpoint, rank))
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, endpoint_for_rank(config.replay_endpoint, rank))
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
                    batch = False
                if batch is None:
                    return
                if batch:
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
            if start is None:
                logger.warning("Rank %d ignored a malformed KV event replay request.", self.rank)
                continue
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([*envelope, seq_bytes(seq), payload])
            self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        if self._own_ctx:
            self._ctx.term()


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def make_publisher(config: KVEventsConfig | None, rank: int) -> ZmqEventPublisher | None:
    if config is None or not config.publishes:
        return None
    return ZmqEventPublisher(config, rank)


def resolve_kv_events_config(value: dict[str, Any] | str | None) -> KVEventsConfig | None:
    """``--kv-events-config`` (a dict or JSON) as a checked config; None when off."""
    value = parse_json_object(value, "kv_events_config")
    if value is None:
        return None
    try:
        config = msgspec.convert(value, KVEventsConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_events_config is not valid: {e}.") from e
    if not config.enable_kv_cache_events:
        return None
    endpoint_for_rank(config.endpoint, 0)  # a malformed endpoint fails now, not in the engine
    if config.replay_endpoint is not None:
        endpoint_for_rank(config.replay_endpoint, 0)
    return config
