"""All of weft's ZMQ plumbing: one socket factory, typed send/receive, addresses.

Call sites never spell an address or set a socket option: they ask for an
``ipc_address`` (processes on one node) or a ``tcp_address`` (across nodes),
open sockets with ``make_socket`` and move Structs with ``send``/``recv``
(blocking sockets) or ``asend``/``arecv`` (``zmq.asyncio`` sockets), which
encode and decode with ``protocol.codec``.

A message is ``[*header, body, *buffers]``: header frames are raw bytes that
the transport needs (a ROUTER peer's identity, a request-type byte), the
rest is what ``codec.Encoder`` produced.

Every socket refuses frames over ``max_msg_size`` (a peer that sends one is
disconnected before libzmq buffers it), and ``tcp://`` sockets send ZMTP
heartbeats and TCP keepalives, so a peer that vanished without closing its
connection (a node that lost power, a cut cable) is noticed in seconds.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from protocol.codec import Decoder, Encoder
from protocol.curve import CurveKeys

T = TypeVar("T")
SocketT = TypeVar("SocketT", bound="zmq.Socket[Any]")

# Data sockets queue without bound: back-pressure is the scheduler's job, and
# a high-water mark would silently drop (PUSH blocks, ROUTER drops) messages.
_NO_RCVHWM = frozenset({zmq.PULL, zmq.DEALER, zmq.ROUTER})
_NO_SNDHWM = frozenset({zmq.PUSH, zmq.DEALER, zmq.ROUTER})

# The largest frame any socket accepts from a peer. The biggest legitimate
# ones are KV blocks (~0.7 MiB each for the default model, a few MiB for 7B
# models) and prompts (a few MiB at most); past this a peer is disconnected.
DEFAULT_MAX_MSG_SIZE = 64 << 20
# tcp:// only: a ZMTP ping every HEARTBEAT_IVL_MS, the connection dropped when
# nothing came back for HEARTBEAT_TIMEOUT_MS; TCP keepalive under it.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
_KEEPALIVE_IDLE_S = 10
_KEEPALIVE_INTVL_S = 5

_ipc_dir: str | None = None
_IPC_PREFIX = "weft-ipc-"
_IPC_OWNER_FILE = "owner"  # "<pid> <start time>" of the process that made the folder


def make_socket(
    ctx: zmq.Context[SocketT],
    socket_type: int,
    address: str,
    *,
    bind: bool,
    identity: bytes | None = None,
    linger: int = 0,
    curve: CurveKeys | None = None,
    router_mandatory: bool = False,
    max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
    hwm: int | None = None,
) -> SocketT:
    """Open, configure and bind or connect one socket.

    ``linger`` (ms) is how long closing waits for unsent messages; 0 drops
    them, which is right for sockets whose peer may already be gone.
    ``curve`` makes it a CurveZMQ server (binding side) or client; a server's
    context needs a ``protocol.curve.ZapAuthenticator`` to let clients in.
    ``router_mandatory``: a ROUTER's send to an identity that is not
    connected raises ``zmq.ZMQError`` (EHOSTUNREACH) instead of dropping the
    message silently. No socket uses ROUTER_HANDOVER: a second connection
    with a connected peer's identity is refused, never handed the first's
    traffic (engine cores use a fresh identity per process, see
    ``instance_identity``). ``hwm`` bounds both queues (messages) where the
    socket's default would be unbounded or libzmq's.
    """
    sock = ctx.socket(socket_type)
    if socket_type in _NO_RCVHWM:
        sock.setsockopt(zmq.RCVHWM, 0)
    if socket_type in _NO_SNDHWM:
        sock.setsockopt(zmq.SNDHWM, 0)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if router_mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if is_tcp(address):
        _keep_alive(sock)
    if curve is not None:
        curve.apply(sock)
    sock.setsockopt(zmq.LINGER, linger)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def _keep_alive(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, _KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, _KEEPALIVE_INTVL_S)


def is_unreachable(error: zmq.ZMQError) -> bool:
    """A ``router_mandatory`` send to a peer that is not connected."""
    return error.errno == errno.EHOSTUNREACH


def bound_address(sock: zmq.Socket[Any]) -> str:
    """The address a bound socket listens on (the real port for ``tcp_address(host, 0)``)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def ipc_address(name: str) -> str:
    """A fresh ``ipc://`` address in a temporary folder owned by this process.

    The folder is mode 0700: only this user can reach the sockets in it,
    which is what authenticates local links (no CURVE needed on them).
    """
    global _ipc_dir
    if _ipc_dir is None:
        remove_stale_ipc_dirs()
        _ipc_dir = tempfile.mkdtemp(prefix=_IPC_PREFIX)  # created 0700
        os.chmod(_ipc_dir, 0o700)  # and said so, whatever mkdtemp does elsewhere
        Path(_ipc_dir, _IPC_OWNER_FILE).write_text(_process_tag(os.getpid()) or "")
        atexit.register(shutil.rmtree, _ipc_dir, True)
    # Unix socket paths are limited to ~107 bytes: keep names short.
    return f"ipc://{os.path.join(_ipc_dir, f'{name}-{uuid.uuid4().hex[:8]}')}"


def remove_stale_ipc_dirs(parent: str | None = None) -> list[str]:
    """Delete the ipc folders that processes of this user left behind when
    killed (no atexit ran): those whose owner file names a process that is
    gone. Folders of live processes, of other users, or without an owner file
    are left alone. Returns the folders removed."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(_IPC_PREFIX) or not _owned_dir(entry):
            continue
        try:
            tag = Path(entry.path, _IPC_OWNER_FILE).read_text()
        except OSError:
            continue  # being created right now, or not ours to judge
        pid = tag.split(" ", 1)[0]
        if pid.isdigit() and _process_tag(int(pid)) != tag:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _owned_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
    except OSError:
        return False


def _process_tag(pid: int) -> str | None:
    """``"<pid> <start time>"`` of a live process, None if there is none: the
    start time tells a reused pid from the process that wrote the tag."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return str(pid)  # no /proc: the pid alone
    # Fields after the command name (which may hold spaces): starttime is the 22nd field.
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"


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
    return address[len("tcp://") :].rsplit(":", 1)[0]


def rank_identity(rank: int) -> bytes:
    """The data-parallel rank, 2 bytes little-endian: how an identity starts."""
    return rank.to_bytes(2, "little")


def instance_identity(rank: int) -> bytes:
    """An engine core process's DEALER identity: its rank and 8 random bytes.

    Fresh per process, so a restarted rank never collides with the
    connection of its dead predecessor, and the API can bind a rank to the
    one connection that shook hands for it (a peer claiming the rank from
    another connection cannot guess the identity)."""
    return rank_identity(rank) + os.urandom(8)


def identity_rank(identity: bytes) -> int:
    return int.from_bytes(identity[:2], "little")


def _frames(encoder: Encoder, obj: object, header: Sequence[bytes]) -> list[bytes | memoryview]:
    return [*header, *encoder.encode(obj)]


def send(sock: zmq.Socket[bytes], encoder: Encoder, obj: object, *header: bytes) -> None:
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


def recv(sock: zmq.Socket[bytes], decoder: Decoder[T], num_header: int = 0) -> tuple[list[bytes], T]:
    """Receive one message; raises ``codec.DecodeError`` (or ValueError) if it is malformed."""
    header, body = split(sock.recv_multipart(copy=False), num_header)
    return header, decoder.decode(body)


async def arecv(sock: zmq.asyncio.Socket, decoder: Decoder[T], num_header: int = 0) -> tuple[list[bytes], T]:
    header, body = split(await sock.recv_multipart(copy=False), num_header)
    return header, decoder.decode(body)
