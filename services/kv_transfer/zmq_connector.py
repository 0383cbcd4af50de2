"""ZmqConnector: KV blocks through the kv_transfer service (``weft kv-transfer``).

The client is a DEALER socket owned by the worker's transfer thread. Each
request carries a sequence number and its reply is awaited for at most
``timeout_s`` (plus the get's own wait); a late reply to an older request is
dropped. When the service does not answer, the socket is replaced (so
nothing queued for a dead peer is sent later) and the transfer fails: the
producer's blocks are released, the consumer computes the prompt.
"""
from __future__ import annotations

import itertools
import logging
import time

import zmq

from protocol.codec import DecodeError, Decoder, Encoder
from protocol.kv_transfer import KVBlock, KVGet, KVPut, KVServiceReply, KVServiceStats, KVStatsRequest
from protocol.zmq_sockets import make_socket, recv, send, tcp_address
from services.kv_transfer.block_connector import BlockConnector
from services.kv_transfer.block_store import BlockStore
from services.kv_transfer.config import ZmqOptions

logger = logging.getLogger(__name__)


class ZmqBlockStore(BlockStore):
    """A client of the kv_transfer service. Not thread-safe: one per thread."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._encoder = Encoder()
        self._decoder = Decoder(KVServiceReply)
        self._seq = itertools.count(1)

    def put(self, blocks: list[KVBlock]) -> None:
        reply = self._request(KVPut(next(self._seq), blocks), self.timeout_s)
        if reply.num_rejected:
            logger.warning("The kv_transfer service refused %d block(s) larger than its memory cap.",
                           reply.num_rejected)

    def get(self, keys: list[bytes], wait_s: float) -> dict[bytes, KVBlock]:
        reply = self._request(KVGet(next(self._seq), keys, int(wait_s * 1000)), wait_s + self.timeout_s)
        return {block.key: block for block in reply.blocks}

    def stats(self) -> KVServiceStats:
        return self._request(KVStatsRequest(next(self._seq)), self.timeout_s)

    def _request(self, message, timeout_s: float):
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
                return reply
        self.close()  # a fresh socket next time: nothing stale queued for a dead service
        raise TimeoutError(f"the kv_transfer service at {self.address} did not answer in {timeout_s:.1f}s")

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER, self.address, bind=False)
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class ZmqConnector(BlockConnector):
    def _make_store(self) -> ZmqBlockStore:
        options = self.options
        assert isinstance(options, ZmqOptions)
        return ZmqBlockStore(tcp_address(self.kv_config.kv_ip, self.kv_config.kv_port), options.timeout_s)
