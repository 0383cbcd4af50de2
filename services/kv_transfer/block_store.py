"""Where KV blocks go between a producer and a consumer: a key -> block store.

A block is a ``protocol.kv_transfer.KVBlock``: raw bytes plus the dtype,
shape and checksum (or MAC) its producer recorded. Stores keep blocks as
they were given; checking them is the consumer's job (``is_intact``), so a
block damaged or forged anywhere on the way -- in a file, in the service's
memory, on the wire -- is caught at the one place that would otherwise
load it. Torch-free: the scheduler side probes stores too.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import zlib
from abc import ABC, abstractmethod

import msgspec
import numpy as np

from protocol.kv_transfer import KVBlock

MAC_BYTES = 32
# Bytes per element of the dtypes a KV cache may have (torch's names; numpy has no bfloat16).
_ITEMSIZE = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def checksum(data: np.ndarray | memoryview | bytes) -> int:
    """CRC-32 of a block's bytes: catches damage, not forgery, at ~1 GB/s."""
    return zlib.crc32(data)


def block_mac(mac_key: bytes, key: bytes, dtype: str, shape: list[int], data) -> bytes:
    """Keyed BLAKE2b over everything a consumer relies on: a block moved to
    another key, given another shape, or with other bytes fails it."""
    mac = hashlib.blake2b(key=mac_key, digest_size=MAC_BYTES)
    # Length-prefixed fields, so no two different (key, header) pairs hash alike.
    header = msgspec.msgpack.encode([key, dtype, list(shape)])
    mac.update(len(header).to_bytes(8, "little"))
    mac.update(header)
    mac.update(data)
    return mac.digest()


def seal(block: KVBlock, mac_key: bytes | None) -> KVBlock:
    """The producer's side: a MAC with a key, else a CRC-32."""
    if mac_key is None:
        block.checksum = checksum(block.data)
    else:
        block.checksum = 0
        block.mac = block_mac(mac_key, block.key, block.dtype, block.shape, block.data)
    return block


def is_intact(block: KVBlock, dtype: str, shape: list[int], mac_key: bytes | None = None) -> bool:
    """True when ``block`` is what its producer recorded and what this consumer
    expects; with ``mac_key`` only a block sealed with that key passes."""
    if not (block.dtype == dtype and list(block.shape) == list(shape) and block.data.dtype == np.uint8):
        return False
    if block.data.nbytes != math.prod(shape) * _ITEMSIZE.get(dtype, 0):
        return False  # bytes that do not fill the shape it claims (or an unknown dtype)
    if mac_key is None:
        return checksum(block.data) == block.checksum
    expected = block_mac(mac_key, block.key, block.dtype, block.shape, block.data)
    return hmac.compare_digest(expected, bytes(block.mac))


class BlockStore(ABC):
    # True when the scheduler may ask ``num_present`` on its own, cheaply
    # (a local stat), to find blocks no request parameter announced.
    discoverable: bool = False

    @abstractmethod
    def put(self, blocks: list[KVBlock]) -> None:
        """Store blocks; raises OSError or TimeoutError when they could not be."""

    @abstractmethod
    def get(self, keys: list[bytes], wait_s: float) -> dict[bytes, KVBlock]:
        """The blocks found, waiting up to ``wait_s`` for missing ones;
        raises OSError or TimeoutError when the store cannot be reached."""

    def num_present(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are stored (discoverable stores only)."""
        raise NotImplementedError(f"{type(self).__name__} is not discoverable")

    def close(self) -> None:
        """Release sockets or files; safe to call twice."""
