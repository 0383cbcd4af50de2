"""KV cache events: what an engine core's prefix cache gained and lost.

An engine core publishes one ``KVEventBatch`` per step that changed its
cache, on a ZMQ PUB socket, as the multipart message
``[topic, seq, payload]``: ``seq`` is the batch's sequence number (8 bytes,
big-endian, from 0 per process) and ``payload`` the msgpack of the batch.
A subscriber that sees a gap in ``seq`` asks the replay socket (ROUTER) for
the batches from N on: it sends ``[b"", N as 8 bytes]`` from a DEALER (or
``[N]`` from a REQ), and gets ``[b"", seq, payload]`` for every batch still
buffered from N on, then ``[b"", END_OF_REPLAY, b""]``. The names and
framing follow vLLM's ``KVEventBatch`` and ZMQ publisher, so routers built
for vLLM can read weft's events.

A subscriber that applies every batch in order holds exactly the engine's
set of cached block hashes: a hash is stored once when it enters the cache
and removed once when its last block leaves it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# The seq of the frame that ends a replay (a signed 8-byte -1, as vLLM sends).
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, frozen=True, tag=True):
    """Consecutive full blocks of one request entered the cache.

    ``parent_block_hash`` is the hash of the block before the first (None
    when the first is the request's first block); ``token_ids`` are all the
    blocks' tokens, ``block_size`` per block.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None  # where the blocks live: "GPU" (device memory) or "CPU"


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    """These hashes left the cache (their last block was handed out again)."""

    block_hashes: list[bytes]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    """Every hash left the cache (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True):
    ts: float  # wall-clock time of the step, seconds since the epoch
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


class KVEventsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``--kv-events-config``, with vLLM's names and defaults.

    Each data-parallel rank binds its own sockets: a ``tcp://`` endpoint's
    port is offset by the rank, an ``ipc://`` or ``inproc://`` one gets a
    ``_dp<rank>`` suffix.
    """

    enable_kv_cache_events: Annotated[bool, Meta(description="Record and publish KV cache events.")] = False
    publisher: Annotated[
        Literal["null", "zmq"], Meta(description="null: record nothing; zmq: publish on a PUB socket.")
    ] = "null"
    endpoint: Annotated[str, Meta(description="Address the PUB socket binds (rank 0's; others offset).")] = (
        "tcp://*:5557"
    )
    replay_endpoint: Annotated[
        str | None, Meta(description="Address of the replay ROUTER (None: no replay).")
    ] = None
    buffer_steps: Annotated[int, Meta(ge=1, description="Batches kept for replay.")] = 10_000
    hwm: Annotated[int, Meta(ge=0, description="PUB socket high-water mark (messages).")] = 100_000
    max_queue_size: Annotated[
        int, Meta(ge=1, description="Batches waiting to be sent before new ones are dropped.")
    ] = 100_000
    topic: Annotated[
        str, Meta(description="Topic frame of every message (subscribers filter on its prefix).")
    ] = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The address one data-parallel rank binds, derived from rank 0's."""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"kv events endpoint {endpoint!r} needs a port, e.g. tcp://*:5557.")
        return f"{host}:{int(port) + rank}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    raise ValueError(f"kv events endpoint {endpoint!r} must be tcp://, ipc:// or inproc://.")


def connect_address(bind_endpoint: str, host: str = "127.0.0.1") -> str:
    """Where a subscriber connects to reach a socket bound at ``bind_endpoint`` (``*`` -> ``host``)."""
    if bind_endpoint.startswith("tcp://*:"):
        return f"tcp://{host}:{bind_endpoint.rsplit(':', 1)[1]}"
    return bind_endpoint


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
