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

Exposure: the sockets bind loopback by default; a ``tcp://`` endpoint that
other hosts can reach is refused unless CurveZMQ guards it (``keys_dir``,
by default the engine's ``--zmq-curve-keys``). ``BlockStored.token_ids``
(the tenants' prompts) is empty unless ``include_token_ids`` is set: the
API's router needs only the hashes.
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
    """``--kv-events-config``, with vLLM's names (defaults safer than vLLM's:
    loopback, hashes only).

    Each data-parallel rank binds its own sockets: a ``tcp://`` endpoint's
    port is offset by the rank, an ``ipc://`` or ``inproc://`` one gets a
    ``_dp<rank>`` suffix.
    """

    enable_kv_cache_events: Annotated[bool, Meta(description="Record and publish KV cache events.")] = False
    publisher: Annotated[
        Literal["null", "zmq"], Meta(description="null: record nothing; zmq: publish on a PUB socket.")
    ] = "null"
    endpoint: Annotated[str, Meta(description="Address the PUB socket binds (rank 0's; others offset).")] = (
        "tcp://127.0.0.1:5557"
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
    include_token_ids: Annotated[
        bool, Meta(description="Put the blocks' token ids (prompt text) in BlockStored; off: hashes only.")
    ] = False
    keys_dir: Annotated[
        str | None,
        Meta(description="A `weft keys` folder: CurveZMQ on both sockets (default: --zmq-curve-keys)."),
    ] = None

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The address one data-parallel rank binds, derived from rank 0's."""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"kv events endpoint {endpoint!r} needs a port, e.g. tcp://127.0.0.1:5557.")
        return f"{host}:{int(port) + rank}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    raise ValueError(f"kv events endpoint {endpoint!r} must be tcp://, ipc:// or inproc://.")


_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def is_exposed(endpoint: str) -> bool:
    """A ``tcp://`` endpoint other hosts may reach (any host but loopback)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host not in _LOOPBACK_HOSTS and not host.startswith("127.")


def check_endpoints(config: KVEventsConfig, data_parallel_size: int, *, has_keys: bool) -> None:
    """ValueError when an endpoint is exposed without CURVE keys, or when the
    ranks' PUB and replay ports would overlap (rank r binds port + r)."""
    for name, endpoint in (("endpoint", config.endpoint), ("replay_endpoint", config.replay_endpoint)):
        if endpoint is not None and is_exposed(endpoint) and not has_keys and config.keys_dir is None:
            raise ValueError(
                f"kv_events_config {name} {endpoint!r} is reachable from other hosts: it needs CurveZMQ "
                "(--zmq-curve-keys, or keys_dir), or bind loopback (tcp://127.0.0.1:PORT) or ipc://."
            )
    if config.replay_endpoint is None or not config.endpoint.startswith("tcp://"):
        return
    if not config.replay_endpoint.startswith("tcp://"):
        return
    pub = int(endpoint_for_rank(config.endpoint, 0).rpartition(":")[2])
    replay = int(endpoint_for_rank(config.replay_endpoint, 0).rpartition(":")[2])
    if abs(pub - replay) < data_parallel_size:
        raise ValueError(
            f"kv_events_config: rank r binds endpoint port {pub} + r and replay port {replay} + r; with "
            f"{data_parallel_size} ranks these overlap: put them at least {data_parallel_size} ports apart "
            f"(e.g. replay_endpoint tcp://127.0.0.1:{pub + max(100, data_parallel_size)})."
        )


def connect_address(bind_endpoint: str, host: str = "127.0.0.1") -> str:
    """Where a subscriber connects to reach a socket bound at ``bind_endpoint``: a wildcard
    bind (``*``, ``0.0.0.0``, ``[::]``) is reached at ``host``, the rank's own address."""
    if bind_endpoint.startswith("tcp://"):
        bound_host, _, port = bind_endpoint[len("tcp://") :].rpartition(":")
        if bound_host in ("*", "0.0.0.0", "[::]"):
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"  # IPv6 literal
            return f"tcp://{host}:{port}"
    return bind_endpoint


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
