"""Where KV blocks go between a producer and a consumer: a key -> block store.

A block is a ``protocol.kv_transfer.KVBlock``: raw bytes plus the dtype,
shape and checksum its producer recorded. Stores keep blocks as they were
given; checking them is the consumer's job (``is_intact``), so a block
damaged anywhere on the way -- in a file, in the service's memory, on the
wire -- is caught at the one place that would otherwise load it.
Torch-free: the scheduler side probes stores too.
"""
from __future__ import annotations

import zlib
from abc import ABC, abstractmethod

import numpy as np

from protocol.kv_transfer import KVBlock


def checksum(data: np.ndarray | memoryview | bytes) -> int:
    """CRC-32 of a block's bytes: catches damage, not forgery, at ~1 GB/s."""
    return zlib.crc32(data)


def is_intact(block: KVBlock, dtype: str, shape: list[int]) -> bool:
    """True when ``block`` is what its producer recorded and what this consumer expects."""
    return (block.dtype == dtype and list(block.shape) == list(shape)
            and block.data.dtype == np.uint8 and checksum(block.data) == block.checksum)


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
