"""What a ``weft keys`` folder gives the KV-transfer path.

- CURVE keys: the kv_transfer service is a CurveZMQ server (``server.key_secret``,
  and it lets in only ``client.key``), each engine's ZmqConnector a client
  (``client.key_secret``, and it talks only to ``server.key``); the same
  folder as ``--zmq-curve-keys``.
- the MAC key of KV blocks, derived from the shared client secret key
  (``client.key_secret``, even where a node connects with a key of its own),
  which every engine that transfers KV holds and the kv_transfer service
  does not need: the service stores blocks it cannot forge, and a consumer
  loads only blocks an engine of this deployment sealed.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import zmq.auth

from protocol.curve import CLIENT, SERVER, CurveKeys, load_keys

_MAC_PERSON = b"weft-kv-mac"


def engine_curve_keys(directory: str | os.PathLike) -> CurveKeys:
    return load_keys(directory, CLIENT)


def service_curve_keys(directory: str | os.PathLike) -> CurveKeys:
    return load_keys(directory, SERVER)


def mac_key(directory: str | os.PathLike) -> bytes:
    """32 bytes for keyed BLAKE2b, the same in every engine given the folder."""
    path = Path(directory) / f"{CLIENT}.key_secret"
    if not path.is_file():
        raise ValueError(f"keys_dir: {path} is missing: KV blocks are sealed with a key derived from it.")
    if path.stat().st_mode & 0o077:
        raise ValueError(f"{path} is readable by others; `chmod 600 {path}`.")
    _, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key.")
    return hashlib.blake2b(secret, digest_size=32, person=_MAC_PERSON).digest()
