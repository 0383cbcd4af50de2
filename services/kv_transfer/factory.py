"""Connectors by name (``kv_connector`` in ``--kv-transfer-config``).

Each is imported only when asked for; none imports torch before its worker
side starts.
"""

from __future__ import annotations

import importlib

from protocol import EngineConfig
from services.kv_transfer.base import KVConnectorBase, KVConnectorRole

_CONNECTORS = {
    "SharedStorageConnector": ("services.kv_transfer.shared_storage", "SharedStorageConnector"),
    "ZmqConnector": ("services.kv_transfer.zmq_connector", "ZmqConnector"),
}


def create_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase | None:
    """The configured connector's half for ``role``; None without a kv_transfer config."""
    if config.kv_transfer is None:
        return None
    name = config.kv_transfer.kv_connector
    if name not in _CONNECTORS:
        raise ValueError(f"Unknown kv_connector {name!r}; known: {', '.join(_CONNECTORS)}.")
    module, cls = _CONNECTORS[name]
    return getattr(importlib.import_module(module), cls)(config, role)


def create_worker_connector(config: EngineConfig, kv_caches: list) -> KVConnectorBase | None:
    """The worker half, bound to this worker's paged KV cache."""
    connector = create_connector(config, KVConnectorRole.WORKER)
    if connector is not None:
        connector.register_kv_caches(kv_caches)
    return connector
