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

Per-node keys: ``weft keys --dir DIR --node NAME`` adds a keypair
``node-NAME.key``/``node-NAME.key_secret`` for one engine node. The API lets
in every node key of its folder (and the shared client key), and tells its
sockets which key a peer used (the ZAP User-Id, ``client`` or ``node-NAME``),
so it can bind each rank to the node that shook hands for it: a node cannot
speak for a rank another node serves. A node's folder holds the server's
public key and its own node keypair only (no other node's secret, and no
``client.key_secret`` if the shared key is to be refused); an engine whose
folder holds exactly one node secret uses it instead of the client key.

Files are created mode 0600 in a 0700 folder, and refused on load when group
or others may read them, as ssh refuses a private key that others can read.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

logger = logging.getLogger(__name__)

SERVER, CLIENT = "server", "client"
# libzmq asks the ZAP handler bound here about every CURVE connection.
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "weft"
_POLL_MS = 100
NODE_PREFIX = "node-"
_NODE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class CurveKeys:
    """One role's keys (raw z85 bytes, as libzmq takes them)."""

    role: str  # SERVER (binds, authenticates clients) or CLIENT (connects)
    public: bytes
    secret: bytes
    peer_public: bytes  # the server's public key for a client; the allowed client's for the server
    # Server only: the node keys it also lets in, public key -> its name ("node-NAME").
    node_keys: dict[bytes, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # never print a secret key into a log
        return f"CurveKeys(role={self.role!r}, public={self.public.decode()!r})"

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server or client; call before bind/connect."""
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        if self.role == SERVER:
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
        else:
            sock.curve_serverkey = self.peer_public


def generate_keys(directory: str | os.PathLike[str], *, overwrite: bool = False) -> list[Path]:
    """Write the server and client keypairs into ``directory`` (created 0700)."""
    folder = Path(directory)
    existing = [p for p in _keypair_paths(folder, [SERVER, CLIENT]) if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists; pass overwrite=True (--force) to replace the keys.")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    return _create_keypairs(folder, [SERVER, CLIENT])


def generate_node_keys(
    directory: str | os.PathLike[str], node: str, *, overwrite: bool = False
) -> list[Path]:
    """Add the keypair of engine node ``node`` to a ``weft keys`` folder."""
    if not _NODE_NAME.fullmatch(node):
        raise ValueError(f"A node name is 1 to 64 letters, digits, '.', '_' or '-'; got {node!r}.")
    folder = Path(directory)
    if not (folder / f"{SERVER}.key").is_file():
        raise FileNotFoundError(f"{folder} holds no server key: run `weft keys --dir {folder}` first.")
    name = NODE_PREFIX + node
    paths = _keypair_paths(folder, [name])
    if any(p.exists() for p in paths) and not overwrite:
        raise FileExistsError(f"{paths[0]} exists; pass overwrite=True (--force) to replace it.")
    return _create_keypairs(folder, [name])


def _keypair_paths(folder: Path, names: list[str]) -> list[Path]:
    return [folder / f"{name}.{ext}" for name in names for ext in ("key", "key_secret")]


def _create_keypairs(folder: Path, names: list[str]) -> list[Path]:
    """Write the keypairs ``names`` into ``folder``, replacing any there; the files are 0600."""
    paths = _keypair_paths(folder, names)
    # Created under a tight umask, so no key is readable by others even for an instant.
    old_umask = os.umask(0o077)
    try:
        for path in paths:
            path.unlink(missing_ok=True)
        for name in names:
            zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old_umask)
    for path in paths:
        path.chmod(0o600)
    return paths


def load_keys(directory: str | os.PathLike[str], role: str) -> CurveKeys:
    """The keys ``role`` needs from a ``weft keys`` folder; ValueError if missing or too open."""
    if role not in (SERVER, CLIENT):
        raise ValueError(f"role must be {SERVER!r} or {CLIENT!r}, got {role!r}.")
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(
            f"--zmq-curve-keys: {folder} is not a folder (create one with `weft keys --dir {folder}`)."
        )
    if role == CLIENT:
        node_secrets = sorted(folder.glob(f"{NODE_PREFIX}*.key_secret"))
        own = node_secrets[0] if len(node_secrets) == 1 else folder / f"{CLIENT}.key_secret"
        public, secret = _load_pair(own)
        peer_public, _ = _load(folder / f"{SERVER}.key", secret=False)
        return CurveKeys(role, public, secret, peer_public)
    public, secret = _load_pair(folder / f"{SERVER}.key_secret")
    client_key = folder / f"{CLIENT}.key"
    peer_public = _load(client_key, secret=False)[0] if client_key.is_file() else b""
    nodes = {
        _load(p, secret=False)[0]: p.name.removesuffix(".key")
        for p in sorted(folder.glob(f"{NODE_PREFIX}*.key"))
    }
    if not peer_public and not nodes:
        raise ValueError(f"Missing CURVE key file {client_key} (create the folder with `weft keys`).")
    return CurveKeys(role, public, secret, peer_public, nodes)


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


def _load_pair(path: Path) -> tuple[bytes, bytes]:
    """A keypair file's public and secret key; ValueError if it holds no secret key."""
    public, secret_key = _load(path, secret=True)
    assert secret_key is not None  # _load refuses a secret file without one
    return public, secret_key


class ZapAuthenticator:
    """Answers libzmq's ZAP requests in one context: a CURVE connection is
    allowed only when its client key is the one in the keys folder.

    libzmq has already checked that the client holds the secret key of the
    public key it presents; this decides whether that key is welcome.
    ``num_denied`` counts refused connections and ``denied`` is set at the
    first (for logs, metrics and tests).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[Any]], keys: CurveKeys) -> None:
        assert keys.role == SERVER, "only the binding side authenticates peers"
        # Raw public key -> the User-Id its connections' frames carry.
        self._allowed = {z85.decode(public): name.encode() for public, name in keys.node_keys.items()}
        if keys.peer_public:
            self._allowed[z85.decode(keys.peer_public)] = CLIENT.encode()
        # A plain (non-asyncio) context over the same libzmq context: the
        # handler's socket lives in its own thread.
        self._ctx: zmq.SyncContext = zmq.Context.shadow(ctx.underlying)
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
            return [version, request_id, b"200", b"OK", self._allowed[key], b""]
        self.num_denied += 1
        self.denied.set()
        if self.num_denied % 100 == 1:  # a peer retrying forever must not flood the log
            address = request[3].decode(errors="replace") if len(request) > 3 else "?"
            logger.warning(
                "Refused a %s connection from %s: unknown key (%d refused so far).",
                mechanism.decode(errors="replace") or "?",
                address,
                self.num_denied,
            )
        return [version, request_id, b"400", b"Unknown key", b"", b""]
