"""``kv_transfer_config`` as users give it (a dict, or JSON on the command
line), resolved into the frozen ``KVTransferConfig``.

Torch-free: the API process builds the engine config too. Each connector's
``kv_connector_extra_config`` is checked against its own Struct here, so a
misspelt option fails at start-up, not at the first transfer.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from protocol import EngineConfig
from protocol.kv_transfer import KV_CONNECTORS, KVTransferConfig
from services.config.json_arg import parse_json_object

# How long one transfer may wait: a reply from the kv_transfer service, or
# blocks that a producer has not finished writing yet.
DEFAULT_TIMEOUT_S = 10.0
# Loads and saves one worker runs at once (each on its own thread and store client).
DEFAULT_MAX_CONCURRENT = 4
# The shared folder's size cap: past it, the least recently used blocks are deleted.
DEFAULT_SHARED_STORAGE_MAX_BYTES = 4 << 30


class SharedStorageOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # None: a private folder of this user (``shared_storage.default_storage_path``).
    shared_storage_path: str | None = None
    timeout_s: Annotated[float, Meta(gt=0)] = DEFAULT_TIMEOUT_S
    # A `weft keys` folder: blocks are sealed with a keyed MAC (BLAKE2b) instead of a CRC-32.
    keys_dir: str | None = None
    max_concurrent: Annotated[int, Meta(ge=1, le=64)] = DEFAULT_MAX_CONCURRENT
    # Bytes of block files the folder may hold (least recently used evicted past it).
    max_bytes: Annotated[int, Meta(ge=1 << 20)] = DEFAULT_SHARED_STORAGE_MAX_BYTES


class ZmqOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    timeout_s: Annotated[float, Meta(gt=0)] = DEFAULT_TIMEOUT_S
    # A `weft keys` folder: CurveZMQ to the kv_transfer service, and a keyed MAC on every block.
    # Required (by default the engine's --zmq-curve-keys) unless allow_unauthenticated.
    keys_dir: str | None = None
    max_concurrent: Annotated[int, Meta(ge=1, le=64)] = DEFAULT_MAX_CONCURRENT
    # No keys: blocks from a service that authenticated no one, checked by CRC-32 only
    # (any local user can forge them). For a `weft kv-transfer --insecure-no-curve` on loopback.
    allow_unauthenticated: bool = False


_OPTIONS: dict[str, type[msgspec.Struct]] = {
    "SharedStorageConnector": SharedStorageOptions,
    "ZmqConnector": ZmqOptions,
}
assert set(_OPTIONS) == set(KV_CONNECTORS)


def connector_options(config: KVTransferConfig) -> SharedStorageOptions | ZmqOptions:
    """The connector's typed ``kv_connector_extra_config``; ValueError when it is wrong."""
    try:
        options = msgspec.convert(config.kv_connector_extra_config, _OPTIONS[config.kv_connector])
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_connector_extra_config of {config.kv_connector} is not valid: {e}.") from e
    return options


def resolve_kv_transfer_config(value: dict[str, Any] | str | None) -> KVTransferConfig | None:
    """None (or an empty value) turns KV transfer off; otherwise a validated config."""
    value = parse_json_object(value, "kv_transfer_config")
    if value is None:
        return None
    if value.get("kv_connector") not in KV_CONNECTORS:
        raise ValueError(
            f"kv_transfer_config needs kv_connector, one of {', '.join(KV_CONNECTORS)}; "
            f"got {value.get('kv_connector')!r}."
        )
    try:
        config = msgspec.convert(value, KVTransferConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_transfer_config is not valid: {e}.") from e
    connector_options(config)
    return config


def check_engine_supports(
    config: KVTransferConfig | None, *, tensor_parallel_size: int, enable_prefix_caching: bool
) -> None:
    """Blocks are named by their prefix-cache hashes, and one worker moves them."""
    if config is None:
        return
    if not enable_prefix_caching:
        raise ValueError(
            "kv_transfer_config needs prefix caching (KV blocks are named by their "
            "prefix-cache hashes): drop --no-enable-prefix-caching."
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"kv_transfer_config supports tensor_parallel_size 1 only (got {tensor_parallel_size})."
        )


def with_default_keys_dir(config: EngineConfig, curve_keys: str | None) -> EngineConfig:
    """``config`` whose KV transfer uses the ``--zmq-curve-keys`` folder (CurveZMQ to the service,
    a MAC on every block) unless its ``kv_connector_extra_config`` names a ``keys_dir`` of its own.
    Applied by each engine core to its own folder (the API's path may not exist on its node)."""
    kv = config.kv_transfer
    if kv is None or curve_keys is None or "keys_dir" in kv.kv_connector_extra_config:
        return config
    extra = {**kv.kv_connector_extra_config, "keys_dir": str(curve_keys)}
    kv = msgspec.structs.replace(kv, kv_connector_extra_config=extra)
    return msgspec.structs.replace(config, kv_transfer=kv)


def with_kv_transfer_config(config: EngineConfig, value: dict[str, Any] | str | None) -> EngineConfig:
    """``config`` with its KV transfer replaced by ``value`` (``engine-core
    --kv-transfer-config``: an engine's role may differ from the API's)."""
    if value is None:
        return config
    kv_transfer = resolve_kv_transfer_config(value)
    check_engine_supports(
        kv_transfer,
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        enable_prefix_caching=config.cache.enable_prefix_caching,
    )
    return msgspec.structs.replace(config, kv_transfer=kv_transfer)
