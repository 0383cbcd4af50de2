"""What ``--async-scheduling`` may be combined with (``services/engine_core/async_scheduling.py`` runs it)."""

from __future__ import annotations

from protocol import EngineConfig


def check_async_scheduling(config: EngineConfig) -> None:
    """ValueError for a combination async scheduling does not support."""
    if not config.scheduler.async_scheduling:
        return
    if config.speculative is not None:
        raise ValueError(
            "async_scheduling does not support speculative decoding (speculative_config): the drafts of "
            "step N+1 depend on the tokens step N accepts. Turn one of them off."
        )
    if config.kv_transfer is not None:
        raise ValueError(
            "async_scheduling does not support disaggregated prefill/decode (kv_transfer_config). "
            "Turn one of them off."
        )
