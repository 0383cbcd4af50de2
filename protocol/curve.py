"""CurveZMQ keys and authentication for the links between the API and engine cores.

``weft keys --dir DIR`` writes two keypairs in pyzmq's certificate format
(``zmq.auth``): ``server.key``/``server.key_secret`` for the API, which binds
every link, and ``client.key``/``client.key_secret`` for engine cores, which
connect. Copy the folder to every node; each process loads what its role
needs:

- the API (server) needs its own secret key and the client public key: its
  ``ZapAuthenticator`` lets in only peers that prove they hold the client
  secret key;
- an engine core (client) needs the client keypair and the server public
  key: it talks only to a peer that proves it holds the server secret key.

So a process without the folder can neither connect to the API's sockets
(to inject outputs, pose as a rank, or read the config) nor pose as the API
to an engine core. CURVE also encrypts every frame on the wire.

Files are created mode 0600 in a 0700 folder, and refused on load when group
or others may read them, as ssh refuses a private key that others can read.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

logger = logging.getLogger(__name__)

SERVER, CLIENT = "server", "client"
# libzmq asks the ZAP handler bound here about every CURVE connection.
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "weft"
_POLL_MS = 100


@dataclass(frozen=True)
class CurveKeys:
    """One role's keys (raw z85 bytes, as libzmq takes them)."""

    role: str  # SERVER (binds, authenticates clients) or CLIENT (connects)
    public: bytes
    secret: bytes
    peer_public: bytes  # the server's public key for a client; the allowed client's for the server

    def __repr__(self) -> str:  # never print a secret key into a log
        return f"CurveKeys(role={self.role!r}, public={self.public.decode()!r})"

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server or client; call before bind/connect."""
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        if self.role == SERVER:
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
        else:
            sock.curve_serverkey = self.peer_public


def generate_keys(directory: str | os.PathLike, *, overwrite: bool = False) -> list[Path]:
    """Write the server and client keypairs into ``directory`` (created 0700)."""
    folder = Path(directory)
    names = [folder / f"{role}.{ext}" for role in (SERVER, CLIENT) for ext in ("key", "key_secret")]
    existing = [p for p in names if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists; pass overwrite=True (--force) to replace the keys.")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    # Created under a tight umask, so no key is readable by others even for an instant.
    old_umask = os.umask(0o077)
    try:
        for path in existing:
            path.unlink()
        for role in (SERVER, CLIENT):
            zmq.auth.create_certificates(folder, role)
    finally:
        os.umask(old_umask)
    for path in names:
        path.chmod(0o600)
    return names


def load_keys(directory: str | os.PathLike, role: str) -> CurveKeys:
    """The keys ``role`` needs from a ``weft keys`` folder; ValueError if missing or too open."""
    if role not in (SERVER, CLIENT):
        raise ValueError(f"role must be {SERVER!r} or {CLIENT!r}, got {role!r}.")
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"--zmq-curve-keys: {folder} is not a folder (create one with `weft keys --dir {folder}`).")
    peer = CLIENT if role == SERVER else SERVER
    public, secret = _load(folder / f"{role}.key_secret", secret=True)
    peer_public, _ = _load(folder / f"{peer}.key", secret=False)
    assert secret is not None
    return CurveKeys(role, public, secret, peer_public)


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise ValueError(f"Missing CURVE key file {path} (create the folder with `weft keys`).")
    mode = stat.S_IMODE(path.stat().st_mode)
    if secret and mode & 0o077:
        raise ValueError(f"{path} is readable by others (mode {mode:o}); `chmod 600 {path}`.")
    public, secret_key = zmq.auth.load_certificate(path)
    if secret and secret_key is None:
        raise ValueError(f"{path} holds no secret key.")
    return public, secret_key


class ZapAuthenticator:
    """Answers libzmq's ZAP requests in one context: a CURVE connection is
    allowed only when its client key is the one in the keys folder.

    libzmq has already checked that the client holds the secret key of the
    public key it presents; this decides whether that key is welcome.
    ``num_denied`` counts refused connections and ``denied`` is set at the
    first (for logs, metrics and tests).
    """

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        assert keys.role == SERVER, "only the binding side authenticates peers"
        self._allowed = frozenset({z85.decode(keys.peer_public)})
        # A plain (non-asyncio) context over the same libzmq context: the
        # handler's socket lives in its own thread.
        self._ctx = zmq.Context.shadow(ctx.underlying)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self.num_denied = 0
        self.denied = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zap-authenticator", daemon=True)
        self._thread.start()
        self._bound.wait()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _serve(self) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.linger = 0
        sock.bind(_ZAP_ENDPOINT)
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_MS):
                    sock.send_multipart(self._answer(sock.recv_multipart()))
        finally:
            sock.close()

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # ZAP (RFC 27): version, request id, domain, address, identity, mechanism, credentials...
        version, request_id = (request + [b"", b""])[:2]
        mechanism = request[5] if len(request) > 5 else b""
        key = request[6] if len(request) > 6 else b""
        if mechanism == b"CURVE" and key in self._allowed:
            return [version, request_id, b"200", b"OK", b"engine", b""]
        self.num_denied += 1
        self.denied.set()
        if self.num_denied % 100 == 1:  # a peer retrying forever must not flood the log
            address = request[3].decode(errors="replace") if len(request) > 3 else "?"
            logger.warning("Refused a %s connection from %s: unknown key (%d refused so far).",
                           mechanism.decode(errors="replace") or "?", address, self.num_denied)
        return [version, request_id, b"400", b"Unknown key", b"", b""]
