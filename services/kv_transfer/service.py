"""``weft kv-transfer``: the standalone KV transfer service.

Producers push KV blocks to it and consumers pull them, over one ZMQ ROUTER
socket, with the protocol codec: each block's bytes travel as a raw frame
and are kept as received (no copy, no pickle). Memory is capped: when a put
would go over ``max_bytes`` the least recently used blocks are dropped (a
consumer that then misses them computes the prompt itself).

A get may wait (``wait_ms``) for keys that are not there yet: a producer
answers its client as soon as a request ends and pushes the blocks right
after, so a consumer can ask before they arrive. The service never checks
what it stores; consumers check every block against its recorded checksum
(or keyed MAC), dtype and shape.

Exposure: it listens on loopback unless ``--host`` says otherwise, and with
``--zmq-curve-keys`` only engines holding the client key of that ``weft
keys`` folder may connect (CurveZMQ, encrypted). Its memory is bounded: the
cap counts each entry's bookkeeping (``ENTRY_OVERHEAD`` bytes plus its key and
shape) as well as its data, a frame over ``--max-msg-size`` disconnects its
sender, a get asks for at most ``MAX_KEYS_PER_GET`` keys and waits at most
``MAX_WAIT_MS``, and at most ``MAX_PARKED_GETS`` gets wait at once (more are
answered at once with what is there).

libzmq limits each frame (``--max-msg-size``), not a message: a peer may
send one message of many frames, which libzmq buffers whole before the
service sees it. So the service refuses to start without CurveZMQ (only
keyholders can send anything) unless ``--insecure-no-curve`` on a loopback
host, and drops, unread and counted, any message of more than
``MAX_FRAMES_PER_MESSAGE`` frames or ``--max-message-bytes`` in all.
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
from protocol.curve import CurveKeys, ZapAuthenticator
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
from protocol.zmq_sockets import DEFAULT_MAX_MSG_SIZE, bound_address, make_socket, send, split, tcp_address
from services.kv_transfer.keys import service_curve_keys

logger = logging.getLogger("weft.kv_transfer")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 14579  # vLLM's kv_port default
DEFAULT_MAX_BYTES = 2 << 30
# What one stored block costs beyond its data, key and shape: the Struct, the
# ndarray over the received frame, the frame, the dict entry (measured ~0.5 KiB).
ENTRY_OVERHEAD = 512
MAX_KEY_BYTES = 64  # namespace + block hash is 40
MAX_KEYS_PER_GET = 256
MAX_WAIT_MS = 60_000
MAX_PARKED_GETS = 256
MAX_BLOCKS_PER_PUT = 256  # producers put 16 per message (transfer_thread.CHUNK_BLOCKS)
MAX_FRAMES_PER_MESSAGE = 2 + MAX_BLOCKS_PER_PUT  # identity, the Struct, one frame per block
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_IDLE_POLL_MS = 100  # how often a quiet service checks for a stop


def entry_size(block: KVBlock) -> int:
    """The bytes a stored block holds, as the memory cap counts them."""
    return (
        ENTRY_OVERHEAD
        + block.data.nbytes
        + len(block.key)
        + 8 * len(block.shape)
        + len(block.dtype)
        + len(block.mac)
    )


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
        """Store (or replace) a block; False when it alone is over the cap, or malformed."""
        size = entry_size(block)
        if size > self.max_bytes or len(block.key) > MAX_KEY_BYTES or block.data.dtype.itemsize != 1:
            return False
        old = self._blocks.pop(block.key, None)
        if old is not None:
            self.num_bytes -= entry_size(old)
        self._blocks[block.key] = block
        self.num_bytes += size
        self.stats.num_stored += 1
        while self.num_bytes > self.max_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self.num_bytes -= entry_size(evicted)
            self.stats.num_evicted += 1
        return True

    def get(self, key: bytes) -> KVBlock | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def snapshot(self, seq: int) -> KVServiceStats:
        s = self.stats
        return KVServiceStats(
            seq=seq,
            num_blocks=len(self._blocks),
            num_bytes=self.num_bytes,
            max_bytes=self.max_bytes,
            num_stored=s.num_stored,
            num_hits=s.num_hits,
            num_misses=s.num_misses,
            num_evicted=s.num_evicted,
        )


@dataclass
class _ParkedGet:
    identity: bytes
    request: KVGet
    deadline: float


class KVTransferService:
    def __init__(
        self,
        address: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        curve: CurveKeys | None = None,
        max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.store = LRUBlockStore(max_bytes)
        self.max_message_bytes = max_message_bytes
        self._ctx = zmq.Context()
        # Before the socket binds: no peer is let in unchecked.
        self.auth = ZapAuthenticator(self._ctx, curve) if curve is not None else None
        self._sock = make_socket(
            self._ctx, zmq.ROUTER, address, bind=True, curve=curve, max_msg_size=max_msg_size
        )
        self.address = bound_address(self._sock)
        self._encoder = Encoder()
        self._decoder = Decoder(KVServiceRequest)
        self._parked: list[_ParkedGet] = []
        self._changed = False  # blocks arrived since the parked gets were last looked at
        self.num_dropped = 0  # malformed messages, or over the frame count or byte limits
        self.num_refused_gets = 0  # over MAX_KEYS_PER_GET, or beyond MAX_PARKED_GETS (answered at once)

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set, then close the socket."""
        try:
            while not stop.is_set():
                if self._sock.poll(self._poll_ms()):
                    self._handle(self._sock.recv_multipart(copy=False))
                self._answer_parked(time.monotonic())
        finally:
            self._sock.close(linger=0)
            if self.auth is not None:
                self.auth.stop()
            self._ctx.term()

    def _poll_ms(self) -> int:
        if not self._parked:
            return _IDLE_POLL_MS
        soonest = min(p.deadline for p in self._parked) - time.monotonic()
        return max(0, min(_IDLE_POLL_MS, int(soonest * 1000) + 1))

    def _handle(self, frames: list) -> None:
        try:
            if len(frames) > MAX_FRAMES_PER_MESSAGE:
                raise ValueError(f"{len(frames)} frames, more than {MAX_FRAMES_PER_MESSAGE}")
            size = sum(len(frame) for frame in frames)
            if size > self.max_message_bytes:
                raise ValueError(f"{size} bytes, more than {self.max_message_bytes}")
            (identity,), body = split(frames, 1)
            request = self._decoder.decode(body)
        except (ValueError, DecodeError) as e:
            self.num_dropped += 1
            if self.num_dropped % 100 == 1:
                logger.warning("Dropped a malformed message (%d so far): %s", self.num_dropped, e)
            return
        if isinstance(request, KVPut):
            stored = sum(self.store.put(block) for block in request.blocks)
            self._changed = self._changed or stored > 0
            self._reply(identity, KVPutReply(request.seq, stored, len(request.blocks) - stored))
        elif isinstance(request, KVGet):
            self._park(identity, request)
        elif isinstance(request, KVStatsRequest):
            self._reply(identity, self.store.snapshot(request.seq))

    def _park(self, identity: bytes, request: KVGet) -> None:
        if len(request.keys) > MAX_KEYS_PER_GET:
            self.num_refused_gets += 1
            self._reply(identity, KVGetReply(request.seq, [], list(request.keys[:MAX_KEYS_PER_GET])))
            return
        wait_ms = min(request.wait_ms, MAX_WAIT_MS)
        if len(self._parked) >= MAX_PARKED_GETS:
            self.num_refused_gets += 1
            wait_ms = 0  # answered now with what is here
        self._parked.append(_ParkedGet(identity, request, time.monotonic() + wait_ms / 1000))
        self._changed = True  # look at it once, at least

    def _answer_parked(self, now: float) -> None:
        """Answer the gets whose keys are all here, or whose wait is over.
        Keys are looked up only when blocks arrived (or a get did): a service
        with many parked gets costs nothing per idle poll."""
        if not self._parked:
            return
        changed, self._changed = self._changed, False
        waiting = []
        for parked in self._parked:
            keys = parked.request.keys
            if now < parked.deadline and not (changed and all(key in self.store for key in keys)):
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
    parser = argparse.ArgumentParser(
        prog="weft kv-transfer",
        description=(
            "The KV transfer service of disaggregated prefill/decode: prefill engines push KV blocks to it, "
            'decode engines pull them (--kv-transfer-config \'{"kv_connector": "ZmqConnector", ...}\').'
        ),
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="Interface to listen on (default loopback; 0.0.0.0 for every interface, with "
        "--zmq-curve-keys when other nodes can reach it).",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="Port to listen on (0: any free port)."
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="Memory for blocks, bookkeeping included; past it the least recently used are "
        "dropped (default 2 GiB).",
    )
    parser.add_argument(
        "--max-msg-size",
        type=int,
        default=DEFAULT_MAX_MSG_SIZE,
        help="Largest frame accepted; a peer that sends a bigger one is disconnected (default 64 MiB).",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="Largest message (all its frames together) handled; a bigger one is dropped (default 256 MiB).",
    )
    parser.add_argument(
        "--zmq-curve-keys",
        default=None,
        metavar="DIR",
        help="A `weft keys` folder: only engines holding its client key may connect "
        "(CurveZMQ); give the engines the same folder as keys_dir. Required unless --insecure-no-curve.",
    )
    parser.add_argument(
        "--insecure-no-curve",
        action="store_true",
        help="Run without CurveZMQ, on a loopback --host only: any local user can then read, "
        "replace and flood blocks (default: off; CURVE is required).",
    )
    return parser


def check_exposure(args: argparse.Namespace) -> None:
    """CurveZMQ unless the operator opted out, and then only on loopback."""
    if args.zmq_curve_keys is not None:
        return
    if not args.insecure_no_curve:
        raise ValueError(
            "needs --zmq-curve-keys DIR (a `weft keys --dir DIR` folder; give the engines the same "
            "folder as keys_dir), or --insecure-no-curve on a loopback --host."
        )
    if args.host not in _LOOPBACK:
        raise ValueError(f"--insecure-no-curve listens on loopback only, not on --host {args.host}.")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_exposure(args)
        curve = service_curve_keys(args.zmq_curve_keys) if args.zmq_curve_keys is not None else None
        service = KVTransferService(
            tcp_address(args.host, args.port, bind=True),
            args.max_bytes,
            curve=curve,
            max_msg_size=args.max_msg_size,
            max_message_bytes=args.max_message_bytes,
        )
    except (ValueError, zmq.ZMQError) as e:
        print(f"weft kv-transfer: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.info(
        "KV transfer service listening on %s (%.0f MiB for blocks, %s)",
        service.address,
        args.max_bytes / 2**20,
        "CurveZMQ" if args.zmq_curve_keys else "no authentication",
    )
    service.serve(stop)
    return 0
