"""All of weft's ZMQ plumbing: one socket factory, typed send/receive, addresses.

Call sites never spell an address or set a socket option: they ask for an
``ipc_address`` (processes on one node) or a ``tcp_address`` (across nodes),
open sockets with ``make_socket`` and move Structs with ``send``/``recv``
(blocking sockets) or ``asend``/``arecv`` (``zmq.asyncio`` sockets), which
encode and decode with ``protocol.codec``.

A message is ``[*header, body, *buffers]``: header frames are raw bytes that
the transport needs (a ROUTER peer's identity, a request-type byte), the
rest is what ``codec.Encoder`` produced.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from typing import TypeVar

import zmq
import zmq.asyncio

from protocol.codec import Decoder, Encoder
from protocol.curve import CurveKeys

T = TypeVar("T")

# Data sockets queue without bound: back-pressure is the scheduler's job, and
# a high-water mark would silently drop (PUSH blocks, ROUTER drops) messages.
_NO_RCVHWM = frozenset({zmq.PULL, zmq.DEALER, zmq.ROUTER})
_NO_SNDHWM = frozenset({zmq.PUSH, zmq.DEALER, zmq.ROUTER})

_ipc_dir: str | None = None


def make_socket(ctx: zmq.Context, socket_type: int, address: str, *, bind: bool,
                identity: bytes | None = None, linger: int = 0, curve: CurveKeys | None = None,
                router_handover: bool = False) -> zmq.Socket:
    """Open, configure and bind or connect one socket.

    ``linger`` (ms) is how long closing waits for unsent messages; 0 drops
    them, which is right for sockets whose peer may already be gone.
    ``curve`` makes it a CurveZMQ server (binding side) or client; a server's
    context needs a ``protocol.curve.ZapAuthenticator`` to let clients in.
    ``router_handover`` lets a peer that reconnects with a known identity (a
    restarted engine core) take it over from a connection not yet seen dead.
    """
    sock = ctx.socket(socket_type)
    if socket_type in _NO_RCVHWM:
        sock.setsockopt(zmq.RCVHWM, 0)
    if socket_type in _NO_SNDHWM:
        sock.setsockopt(zmq.SNDHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if router_handover:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if curve is not None:
        curve.apply(sock)
    sock.setsockopt(zmq.LINGER, linger)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def bound_address(sock: zmq.Socket) -> str:
    """The address a bound socket listens on (the real port for ``tcp_address(host, 0)``)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def ipc_address(name: str) -> str:
    """A fresh ``ipc://`` address in a temporary folder owned by this process.

    The folder is mode 0700: only this user can reach the sockets in it,
    which is what authenticates local links (no CURVE needed on them).
    """
    global _ipc_dir
    if _ipc_dir is None:
        _ipc_dir = tempfile.mkdtemp(prefix="weft-")  # created 0700
        os.chmod(_ipc_dir, 0o700)  # and said so, whatever mkdtemp does elsewhere
        atexit.register(shutil.rmtree, _ipc_dir, True)
    # Unix socket paths are limited to ~107 bytes: keep names short.
    return f"ipc://{os.path.join(_ipc_dir, f'{name}-{uuid.uuid4().hex[:8]}')}"


def tcp_address(host: str, port: int, *, bind: bool = False) -> str:
    """A ``tcp://`` address. To bind, port 0 means any free port (read the
    real one with ``bound_address``); a peer cannot connect to port 0."""
    lowest = 0 if bind else 1
    if not lowest <= port <= 65535:
        raise ValueError(f"port must be in [{lowest}, 65535], got {port}.")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"tcp://{host}:{'*' if port == 0 else port}"


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def tcp_host(address: str) -> str:
    """The host part of a ``tcp://host:port`` address."""
    if not is_tcp(address):
        raise ValueError(f"Not a tcp:// address: {address!r}.")
    return address[len("tcp://"):].rsplit(":", 1)[0]


def rank_identity(rank: int) -> bytes:
    """A DEALER's identity: its data-parallel rank, 2 bytes little-endian."""
    return rank.to_bytes(2, "little")


def identity_rank(identity: bytes) -> int:
    return int.from_bytes(identity, "little")


def _frames(encoder: Encoder, obj: object, header: Sequence[bytes]) -> list:
    return [*header, *encoder.encode(obj)]


def send(sock: zmq.Socket, encoder: Encoder, obj: object, *header: bytes) -> None:
    sock.send_multipart(_frames(encoder, obj, header), copy=False)


async def asend(sock: zmq.asyncio.Socket, encoder: Encoder, obj: object, *header: bytes) -> None:
    await sock.send_multipart(_frames(encoder, obj, header), copy=False)


def split(frames: Sequence[zmq.Frame | bytes], num_header: int) -> tuple[list[bytes], list[memoryview]]:
    """Header frames as bytes, the message frames as buffers for the codec."""
    if len(frames) <= num_header:
        raise ValueError(f"Expected more than {num_header} frames, got {len(frames)}.")
    header = [f.bytes if isinstance(f, zmq.Frame) else f for f in frames[:num_header]]
    body = [f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in frames[num_header:]]
    return header, body


def recv(sock: zmq.Socket, decoder: Decoder[T], num_header: int = 0) -> tuple[list[bytes], T]:
    """Receive one message; raises ``codec.DecodeError`` (or ValueError) if it is malformed."""
    header, body = split(sock.recv_multipart(copy=False), num_header)
    return header, decoder.decode(body)


async def arecv(sock: zmq.asyncio.Socket, decoder: Decoder[T], num_header: int = 0) -> tuple[list[bytes], T]:
    header, body = split(await sock.recv_multipart(copy=False), num_header)
    return header, decoder.decode(body)
