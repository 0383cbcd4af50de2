"""ZmqConnector: KV blocks through the kv_transfer service (``weft kv-transfer``).

The client is a DEALER socket owned by the worker's transfer thread. Each
request carries a sequence number and its reply is awaited for at most
``timeout_s`` (plus the get's own wait); a late reply to an older request is
dropped. When the service does not answer, the socket is replaced (so
nothing queued for a dead peer is sent later) and the transfer fails: the
producer's blocks are released, the consumer computes the prompt. A service
that did not answer is *known down* for ``DOWN_RETRY_S``: every client of it
in the process fails at once meanwhile, instead of each waiting its full
timeout, and the first request after that tries again.

With ``keys_dir`` the link is CurveZMQ (``services.kv_transfer.keys``): the
client talks only to the holder of the server key, and the service lets in
only holders of the client key.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import zmq

from protocol import EngineConfig
from protocol.codec import DecodeError, Decoder, Encoder
from protocol.curve import CurveKeys
from protocol.kv_transfer import KVBlock, KVGet, KVPut, KVServiceReply, KVServiceStats, KVStatsRequest
from protocol.zmq_sockets import make_socket, recv, send, tcp_address
from services.config.kv_transfer_args import ZmqOptions
from services.kv_transfer.base import KVConnectorRole
from services.kv_transfer.block_connector import BlockConnector
from services.kv_transfer.block_store import BlockStore
from services.kv_transfer.keys import engine_curve_keys

logger = logging.getLogger(__name__)

# How long a service that did not answer is taken for down (no request waits on it meanwhile).
DOWN_RETRY_S = 5.0
# (address, own public key) -> monotonic time; shared by every client in the process.
_down_until: dict[tuple[str, bytes | None], float] = {}
_down_lock = threading.Lock()


class ServiceDownError(ConnectionError):
    """The service did not answer a moment ago: not asked again yet."""


class ZmqBlockStore(BlockStore):
    """A client of the kv_transfer service. Not thread-safe: one per thread."""

    def __init__(self, address: str, timeout_s: float, curve: CurveKeys | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.curve = curve
        self._link = (address, None if curve is None else curve.public)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._encoder = Encoder()
        self._decoder = Decoder(KVServiceReply)
        self._seq = itertools.count(1)

    def put(self, blocks: list[KVBlock]) -> None:
        reply = self._request(KVPut(next(self._seq), blocks), self.timeout_s)
        if reply.num_rejected:
            logger.warning(
                "The kv_transfer service refused %d block(s) larger than its memory cap.", reply.num_rejected
            )

    def get(self, keys: list[bytes], wait_s: float) -> dict[bytes, KVBlock]:
        reply = self._request(KVGet(next(self._seq), keys, int(wait_s * 1000)), wait_s + self.timeout_s)
        return {block.key: block for block in reply.blocks}

    def stats(self) -> KVServiceStats:
        return self._request(KVStatsRequest(next(self._seq)), self.timeout_s)

    def _request(self, message, timeout_s: float):
        with _down_lock:
            down_until = _down_until.get(self._link, 0.0)
        if time.monotonic() < down_until:
            raise ServiceDownError(f"the kv_transfer service at {self.address} is down (no answer lately)")
        sock = self._socket()
        send(sock, self._encoder, message)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            try:
                _, reply = recv(sock, self._decoder)
            except (DecodeError, ValueError) as e:
                logger.warning("Dropped a malformed reply from the kv_transfer service: %s", e)
                continue
            if reply.seq == message.seq:
                with _down_lock:
                    _down_until.pop(self._link, None)
                return reply
        self.close()  # a fresh socket next time: nothing stale queued for a dead service
        with _down_lock:
            _down_until[self._link] = time.monotonic() + DOWN_RETRY_S
        raise TimeoutError(f"the kv_transfer service at {self.address} did not answer in {timeout_s:.1f}s")

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER, self.address, bind=False, curve=self.curve)
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class ZmqConnector(BlockConnector):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        options = self.options
        assert isinstance(options, ZmqOptions)
        if role is KVConnectorRole.WORKER and options.keys_dir is None and not options.allow_unauthenticated:
            # The worker moves the blocks: keyless ones would come from a service that
            # authenticated no one, so it refuses to start without keys.
            raise ValueError(
                "ZmqConnector needs keys_dir in kv_connector_extra_config (or --zmq-curve-keys): "
                "CurveZMQ to the kv_transfer service and a MAC on every block; "
                '"allow_unauthenticated": true accepts CRC-checked blocks from any local user.'
            )

    def _make_store(self) -> ZmqBlockStore:
        options = self.options
        assert isinstance(options, ZmqOptions)
        curve = None if options.keys_dir is None else engine_curve_keys(options.keys_dir)
        address = tcp_address(self.kv_config.kv_ip, self.kv_config.kv_port)
        return ZmqBlockStore(address, options.timeout_s, curve)
