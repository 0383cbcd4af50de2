"""Disaggregated prefill/decode on the wire: the KV transfer config, the
parameters a request carries between the two engines, the per-step plan the
scheduler hands its workers, and the messages of the kv_transfer service.

KV blocks are named by their prefix-cache block hash (``services.engine_core
.prefix_hash``, the same in every process), so a producer and a consumer
that see the same prompt agree on every block's key without talking to each
other. Structs marked ``array_like`` travel as msgpack arrays: field ORDER is
the wire contract; append new fields at the end, with defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_CONNECTORS = ("SharedStorageConnector", "ZmqConnector")


class KVTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``--kv-transfer-config``: how this engine hands KV to, or takes it from, other engines."""

    kv_connector: Annotated[str, Meta(description="SharedStorageConnector or ZmqConnector.")]
    kv_role: Annotated[KVRole, Meta(description="kv_producer (prefill), kv_consumer (decode) or kv_both.")]
    kv_ip: Annotated[str, Meta(description="Host of the kv_transfer service (ZmqConnector).")] = "127.0.0.1"
    kv_port: Annotated[
        int, Meta(ge=1, le=65535, description="Port of the kv_transfer service (ZmqConnector).")
    ] = 14579
    kv_connector_extra_config: Annotated[
        dict[str, Any],
        Meta(
            description="Connector options: shared_storage_path (SharedStorageConnector); timeout_s, keys_dir, "
            "max_concurrent (both)."
        ),
    ] = {}

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


class KVTransferParams(msgspec.Struct, omit_defaults=True):
    """``kv_transfer_params`` of a request and of its response (vLLM's names).

    The proxy sends a prefill with ``do_remote_decode``; the producer answers
    with ``do_remote_prefill`` and how many prompt tokens it saved, which the
    proxy passes to the decode engine. Unknown keys are ignored, so params
    written for another connector do no harm.
    """

    do_remote_decode: bool = False  # a producer: save this prompt's KV when the request ends
    do_remote_prefill: bool = False  # a consumer: load the prompt's KV instead of computing it
    remote_num_tokens: Annotated[int, Meta(ge=0)] = 0  # prompt tokens whose KV the producer saved


class KVBlockTransfer(msgspec.Struct, array_like=True, gc=False):
    """Blocks of one request to save (producer) or load (consumer) this step."""

    req_id: str
    block_ids: list[int]  # in the worker's paged KV cache
    block_hashes: list[bytes]  # the blocks' keys, one per block id
    # Loads: how long the blocks may take to appear (a producer may still be
    # pushing them); 0 looks once.
    wait_s: float = 0.0


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's transfer work for the worker. Sent (even empty) whenever a
    transfer is in flight, so the worker reports what has finished."""

    loads: list[KVBlockTransfer] = []
    saves: list[KVBlockTransfer] = []


# ---- the kv_transfer service ------------------------------------------------


class KVBlock(msgspec.Struct, array_like=True, gc=False):
    """One block's KV over all layers, as raw bytes (a zero-copy frame).

    ``dtype`` is torch's name (numpy has no bfloat16), ``shape`` the block's
    tensor shape and ``checksum`` the CRC-32 of ``data``, all recorded by the
    producer: a consumer loads a block only if all three match. With a keys
    folder configured, ``mac`` is a keyed BLAKE2b over key, dtype, shape and
    data instead (``checksum`` is then 0): only a holder of the key can make
    a block a consumer accepts.
    """

    key: bytes
    dtype: str
    shape: list[int]
    checksum: int
    data: np.ndarray  # uint8 [nbytes]
    mac: bytes = b""


class KVPut(msgspec.Struct, tag="put", array_like=True, gc=False):
    seq: int
    blocks: list[KVBlock]


class KVGet(msgspec.Struct, tag="get", array_like=True, gc=False):
    """Blocks by key. The reply waits up to ``wait_ms`` for missing keys."""

    seq: int
    keys: list[bytes]
    wait_ms: Annotated[int, Meta(ge=0)] = 0


class KVStatsRequest(msgspec.Struct, tag="stats", array_like=True, gc=False):
    seq: int


KVServiceRequest = KVPut | KVGet | KVStatsRequest


class KVPutReply(msgspec.Struct, tag="put_reply", array_like=True, gc=False):
    seq: int
    num_stored: int
    num_rejected: int = 0  # larger than the whole memory cap


class KVGetReply(msgspec.Struct, tag="get_reply", array_like=True, gc=False):
    seq: int
    blocks: list[KVBlock]  # the keys found, in request order
    missing: list[bytes] = []


class KVServiceStats(msgspec.Struct, tag="stats_reply", array_like=True, gc=False):
    seq: int
    num_blocks: int = 0
    num_bytes: int = 0
    max_bytes: int = 0
    num_stored: int = 0  # blocks put, ever
    num_hits: int = 0  # blocks handed out, ever
    num_misses: int = 0  # blocks asked for and not there when the wait ended
    num_evicted: int = 0  # blocks dropped to stay under max_bytes (LRU)


KVServiceReply = KVPutReply | KVGetReply | KVServiceStats
