"""``--kv-events-config``: vLLM's KV cache event publishing, checked before any process starts
(``services/engine_core/kv_events.py`` publishes; ``protocol/kv_events.py`` is the wire)."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.kv_events import KVEventsConfig, check_endpoints, endpoint_for_rank
from services.config.json_arg import parse_json_object


def resolve_kv_events_config(
    value: dict[str, Any] | str | None, data_parallel_size: int = 1, *, has_keys: bool = True
) -> KVEventsConfig | None:
    """``--kv-events-config`` (a dict or JSON) as a checked config; None when off."""
    value = parse_json_object(value, "kv_events_config")
    if value is None:
        return None
    try:
        config = msgspec.convert(value, KVEventsConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_events_config is not valid: {e}.") from e
    if not config.enable_kv_cache_events:
        return None
    endpoint_for_rank(config.endpoint, 0)  # a malformed endpoint fails now, not in the engine
    if config.replay_endpoint is not None:
        endpoint_for_rank(config.replay_endpoint, 0)
    check_endpoints(config, data_parallel_size, has_keys=has_keys)
    return config
