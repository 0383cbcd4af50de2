"""``weft kv-transfer``: the standalone KV transfer service.

Producers push KV blocks to it and consumers pull them, over one ZMQ ROUTER
socket, with the protocol codec: each block's bytes travel as a raw frame
and are kept as received (no copy, no pickle). Memory is capped: when a put
would go over ``max_bytes`` the least recently used blocks are dropped (a
consumer that then misses them computes the prompt itself).

A get may wait (``wait_ms``) for keys that are not there yet: a producer
answers its client as soon as a request ends and pushes the blocks right
after, so a consumer can ask before they arrive. The service never checks
what it stores; consumers check every block against its recorded checksum,
dtype and shape.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq

from protocol.codec import DecodeError, Decoder, Encoder
from protocol.kv_transfer import (
    KVBlock,
    KVGet,
    KVGetReply,
    KVPut,
    KVPutReply,
    KVServiceRequest,
    KVServiceStats,
    KVStatsRequest,
)
from protocol.zmq_sockets import bound_address, make_socket, send, split, tcp_address

logger = logging.getLogger("weft.kv_transfer")

DEFAULT_PORT = 14579  # vLLM's kv_port default
DEFAULT_MAX_BYTES = 2 << 30
_IDLE_POLL_MS = 100  # how often a quiet service checks for a stop


class LRUBlockStore:
    """Blocks by key, least recently used first, under a byte cap."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}.")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._blocks: OrderedDict[bytes, KVBlock] = OrderedDict()
        self.stats = KVServiceStats(seq=0, max_bytes=max_bytes)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def put(self, block: KVBlock) -> bool:
        """Store (or replace) a block; False when it alone is over the cap."""
        size = block.data.nbytes
        if size > self.max_bytes:
            return False
        old = self._blocks.pop(block.key, None)
        if old is not None:
            self.num_bytes -= old.data.nbytes
        self._blocks[block.key] = block
        self.num_bytes += size
        self.stats.num_stored += 1
        while self.num_bytes > self.max_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self.num_bytes -= evicted.data.nbytes
            self.stats.num_evicted += 1
        return True

    def get(self, key: bytes) -> KVBlock | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def snapshot(self, seq: int) -> KVServiceStats:
        s = self.stats
        return KVServiceStats(seq=seq, num_blocks=len(self._blocks), num_bytes=self.num_bytes,
                              max_bytes=self.max_bytes, num_stored=s.num_stored, num_hits=s.num_hits,
                              num_misses=s.num_misses, num_evicted=s.num_evicted)


@dataclass
class _ParkedGet:
    identity: bytes
    request: KVGet
    deadline: float


class KVTransferService:
    def __init__(self, address: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.store = LRUBlockStore(max_bytes)
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.ROUTER, address, bind=True)
        self.address = bound_address(self._sock)
        self._encoder = Encoder()
        self._decoder = Decoder(KVServiceRequest)
        self._parked: list[_ParkedGet] = []
        self.num_dropped = 0  # malformed messages

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set, then close the socket."""
        try:
            while not stop.is_set():
                if self._sock.poll(self._poll_ms()):
                    self._handle(self._sock.recv_multipart(copy=False))
                self._answer_parked(time.monotonic())
        finally:
            self._sock.close(linger=0)
            self._ctx.term()

    def _poll_ms(self) -> int:
        if not self._parked:
            return _IDLE_POLL_MS
        soonest = min(p.deadline for p in self._parked) - time.monotonic()
        return max(0, min(_IDLE_POLL_MS, int(soonest * 1000) + 1))

    def _handle(self, frames: list) -> None:
        try:
            (identity,), body = split(frames, 1)
            request = self._decoder.decode(body)
        except (ValueError, DecodeError) as e:
            self.num_dropped += 1
            if self.num_dropped % 100 == 1:
                logger.warning("Dropped a malformed message (%d so far): %s", self.num_dropped, e)
            return
        if isinstance(request, KVPut):
            stored = sum(self.store.put(block) for block in request.blocks)
            self._reply(identity, KVPutReply(request.seq, stored, len(request.blocks) - stored))
        elif isinstance(request, KVGet):
            self._parked.append(_ParkedGet(identity, request, time.monotonic() + request.wait_ms / 1000))
        elif isinstance(request, KVStatsRequest):
            self._reply(identity, self.store.snapshot(request.seq))

    def _answer_parked(self, now: float) -> None:
        """Answer the gets whose keys are all here, or whose wait is over."""
        waiting = []
        for parked in self._parked:
            keys = parked.request.keys
            if now < parked.deadline and not all(key in self.store for key in keys):
                waiting.append(parked)
                continue
            blocks = [b for b in map(self.store.get, keys) if b is not None]
            self.store.stats.num_hits += len(blocks)
            self.store.stats.num_misses += len(keys) - len(blocks)
            missing = [key for key in keys if key not in self.store]
            self._reply(parked.identity, KVGetReply(parked.request.seq, blocks, missing))
        self._parked = waiting

    def _reply(self, identity: bytes, message) -> None:
        send(self._sock, self._encoder, message, identity)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft kv-transfer", description=(
        "The KV transfer service of disaggregated prefill/decode: prefill engines push KV blocks to it, "
        "decode engines pull them (--kv-transfer-config '{\"kv_connector\": \"ZmqConnector\", ...}')."))
    parser.add_argument("--host", default="0.0.0.0", help="Interface to listen on.")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="Port to listen on (0: any free port).")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help="Memory for blocks; past it the least recently used are dropped (default 2 GiB).")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        service = KVTransferService(tcp_address(args.host, args.port, bind=True), args.max_bytes)
    except (ValueError, zmq.ZMQError) as e:
        print(f"weft kv-transfer: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.info("KV transfer service listening on %s (%.0f MiB for blocks)", service.address,
                args.max_bytes / 2**20)
    service.serve(stop)
    return 0
