"""Disaggregated prefill/decode, scheduler side: requests and blocks around
the KV connector. Inert when the engine has no ``kv_transfer`` config.

Consumer: a waiting request whose prompt KV the connector can load is
*parked*: it gets blocks for those tokens (kept out of the prefix cache
until they hold real KV) and waits in WAITING_FOR_REMOTE_KVS, off the
waiting queue, while the worker loads; other requests keep being
scheduled. When the worker reports the load, the request goes back to the
front of the queue with the loaded tokens computed, and runs the rest of
its prompt like any prefix hit. A load that brought fewer blocks (evicted,
damaged, timed out, service dead) simply leaves more to compute.

Producer: a request that ends with blocks to hand on keeps them (out of the
pool) until the worker reports them saved, or ``hold_timeout_s`` passes.

A request aborted while its KV loads keeps its blocks until the load ends
(the worker is still writing them), or until ``abandon_timeout_s`` passes:
a load that never reports back must not leak its blocks. The worker drops a
load that outlives its own deadline (``transfer_thread``), which is well
inside this one, so no late write lands in blocks handed to another request.
"""

from __future__ import annotations

import logging
import time
from typing import TypedDict

from protocol import EngineConfig, ModelRunnerOutput, SchedulerOutput
from protocol.kv_transfer import KVTransferParams
from services.engine_core.block_pool import KVCacheBlock
from services.engine_core.kv_cache_manager import KVCacheManager
from services.engine_core.request import Request, RequestStatus
from services.kv_transfer.base import KVConnectorRole
from services.kv_transfer.factory import create_connector

logger = logging.getLogger(__name__)

# A producer's blocks come back to the pool after this long even if no save
# was reported (a worker that lost the job must not leak them).
HOLD_TIMEOUT_S = 120.0
# An aborted request's loading blocks come back after this long even if the
# load never reports. The worker writes nothing into the cache past a load's
# wait plus one store timeout from its submission (2 x timeout_s, 20 s by
# default): the timeout is at least 3 x timeout_s + 30 s, so no late write can
# land in blocks handed to another request.
ABANDON_TIMEOUT_S = 120.0


class ExternalPrefixStats(TypedDict):
    """``SchedulerStats``' external prefix cache fields (tokens, since the previous stats)."""

    external_prefix_cache_queries: int
    external_prefix_cache_hits: int


class KVTransferScheduling:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.connector = create_connector(config, KVConnectorRole.SCHEDULER)
        self.kv_cache_manager = kv_cache_manager
        self.block_size = config.cache.block_size
        self.hold_timeout_s = HOLD_TIMEOUT_S
        options = getattr(self.connector, "options", None)
        transfer_timeout_s = getattr(options, "timeout_s", 0.0)
        self.abandon_timeout_s = max(ABANDON_TIMEOUT_S, 3 * transfer_timeout_s + 30.0)
        self.waiting_for_remote: dict[str, Request] = {}
        self._load_tried: set[str] = set()  # a request loads at most once
        self._num_external: dict[str, int] = {}  # parked request -> the tokens its load may bring
        self._held: dict[str, tuple[Request, float]] = {}  # finished; blocks kept until saved (deadline)
        # Aborted mid-load; blocks kept until the load ends (or the deadline passes).
        self._abandoned: dict[str, tuple[Request, float]] = {}
        self._queries = self._hits = 0  # tokens, since the previous stats

    # ---- consumer: park, then resume

    def num_external_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """Prompt tokens past the local hit that the connector can load (0: schedule as usual)."""
        if self.connector is None or request.num_computed_tokens or request.request_id in self._load_tried:
            return 0
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        assert load_async or num_external == 0, "connectors here load asynchronously"
        return num_external

    def park(
        self, request: Request, hit_blocks: list[KVCacheBlock], num_hit_tokens: int, num_external: int
    ) -> bool:
        """Allocate blocks for the external tokens and wait for them; False if the pool is short."""
        assert self.connector is not None, "only num_external_tokens > 0 parks a request"
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_external, num_hit_tokens, hit_blocks, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._load_tried.add(request.request_id)
        self.waiting_for_remote[request.request_id] = request
        self._queries += num_external
        self._num_external[request.request_id] = num_external
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        return True

    def _on_loaded(self, request_id: str, num_blocks: int) -> Request | None:
        """A load ended: the request, ready to schedule again (None if it was aborted)."""
        request = self.waiting_for_remote.pop(request_id, None)
        num_external = self._num_external.pop(request_id, 0)
        if request is None:
            abandoned = self._abandoned.pop(request_id, None)
            if abandoned is not None:
                self.kv_cache_manager.free(abandoned[0])
            return None
        # The last block may be a prompt's partial one: it brings only the tokens asked for.
        num_loaded = min(num_blocks * self.block_size, num_external)
        request.num_computed_tokens += num_loaded
        self._hits += num_loaded
        request.status = RequestStatus.WAITING
        if request.num_computed_tokens == 0:
            # Nothing usable: start afresh, as a request that never had blocks.
            self.kv_cache_manager.free(request)
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        return request

    # ---- producer: hold until saved

    def request_finished(self, request: Request) -> tuple[bool, KVTransferParams | None]:
        """(free the blocks now?, the params for the response) of a request that just ended."""
        if self.connector is None:
            return True, None
        request_id = request.request_id
        self._load_tried.discard(request_id)
        if self.waiting_for_remote.pop(request_id, None) is not None:
            self._abandoned[request_id] = (request, time.monotonic() + self.abandon_timeout_s)
            return False, None
        delay_free, params = self.connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request_id)
        )
        if delay_free:
            self._held[request_id] = (request, time.monotonic() + self.hold_timeout_s)
        return not delay_free, params

    def _release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.kv_cache_manager.free(held[0])

    def _release_expired(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, (_, deadline) in self._held.items() if deadline <= now]:
            logger.warning(
                "No save reported for request %s in %.0fs; freeing its blocks.",
                request_id,
                self.hold_timeout_s,
            )
            self._release(request_id)
        for request_id in [r for r, (_, deadline) in self._abandoned.items() if deadline <= now]:
            logger.warning(
                "The load of aborted request %s did not report in %.0fs; freeing its blocks.",
                request_id,
                self.abandon_timeout_s,
            )
            self.kv_cache_manager.free(self._abandoned.pop(request_id)[0])
            self._num_external.pop(request_id, None)
            assert self.connector is not None, "only a connector's loads are abandoned"
            self.connector.forget(request_id)

    # ---- each step

    def build_connector_meta(self, output: SchedulerOutput) -> None:
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply the transfers the workers finished; returns the requests whose loads ended."""
        if self.connector is None:
            return []
        self.connector.update_connector_output(runner_output.finished_sending, runner_output.finished_recving)
        for request_id in runner_output.finished_sending:
            self._release(request_id)
        self._release_expired()
        resumed = (self._on_loaded(r, n) for r, n in runner_output.finished_recving.items())
        return [request for request in resumed if request is not None]

    def has_pending(self) -> bool:
        return bool(self.waiting_for_remote or self._held or self._abandoned)

    def take_stats(self) -> ExternalPrefixStats:
        stats: ExternalPrefixStats = {
            "external_prefix_cache_queries": self._queries,
            "external_prefix_cache_hits": self._hits,
        }
        self._queries = self._hits = 0
        return stats
