"""The KV connector interface, in the manner of vLLM's KVConnectorBase_V1.

A connector has two halves, one object per process role:

- the SCHEDULER half lives in the engine core (no torch). It says how many
  of a waiting request's prompt tokens can be loaded from outside, learns
  which blocks were allocated for them, writes each step's transfer plan
  (``KVConnectorMetadata``, sent to the workers inside the
  ``SchedulerOutput``), and decides what happens when a request ends: keep
  its blocks until they are sent, and which parameters the other engine
  needs (``KVTransferParams``, returned to the client).
- the WORKER half lives next to the paged KV cache. Per step it is bound to
  the plan, starts loads, may be asked per layer to wait for a load or to
  save a layer, finishes the step's saves, and reports which requests have
  finished sending or receiving (``ModelRunnerOutput.finished_sending`` /
  ``finished_recving``).

Requests are the engine core's ``Request`` objects, used by duck typing
(``request_id``, ``block_hashes``, ``num_tokens``, ``num_prompt_tokens``,
``status``, ``sampling_params``, ``kv_transfer_params``) so this package
does not import the engine core.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from protocol import EngineConfig, SchedulerOutput
from protocol.kv_transfer import KVConnectorMetadata, KVTransferConfig, KVTransferParams

if TYPE_CHECKING:
    import torch


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorBase(ABC):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        assert config.kv_transfer is not None, "a connector needs a kv_transfer config"
        self.config = config
        self.kv_config: KVTransferConfig = config.kv_transfer
        self.role = role
        self.block_size = config.cache.block_size
        self._metadata: KVConnectorMetadata | None = None  # worker side: the plan of the current step

    # ------------------------------------------------ scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens past ``num_computed_tokens`` (the local prefix hit)
        that can be loaded from outside, and whether the load is
        asynchronous (the request waits in WAITING_FOR_REMOTE_KVS while it
        runs). Free of side effects: it may be asked again next step."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the request's external tokens: the next
        plan loads them. ``block_ids`` is the request's whole block table."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        """This step's plan for the workers, and a reset of the per-step
        state; None when there is nothing to do or to wait for."""

    @abstractmethod
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        """Called once when a request ends. Returns (delay_free, params):
        True means the blocks are being sent and must be kept until a worker
        reports the request in ``finished_sending``; ``params`` go back to
        the client with the response."""

    def update_connector_output(self, finished_sending: list[str], finished_recving: dict[str, int]) -> None:
        """What the workers reported finished this step."""

    def forget(self, request_id: str) -> None:
        """Stop waiting for a report on ``request_id`` (its transfer timed out)."""

    # ------------------------------------------------ worker side

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The paged KV cache, one ``[2, KVH, num_blocks, block_size, D]`` tensor per layer."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata:
        assert self._metadata is not None, "no metadata bound for this step"
        return self._metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start the loads of the bound plan, before the forward."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s KV is loaded. Whole-block
        connectors load between steps, so the default returns at once."""

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor) -> None:
        """Start saving one layer's KV as soon as the forward wrote it.
        Whole-block connectors save finished requests instead: no-op."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """End of the forward: the step's saves are started (or done)."""

    @abstractmethod
    def get_finished(self, wait_s: float = 0.0) -> tuple[list[str], dict[str, int]]:
        """(requests done sending, {request: blocks loaded} of loads that
        ended) since the last call; waits up to ``wait_s`` for one if none
        has finished yet and transfers are in flight."""

    def shutdown(self) -> None:
        """Stop background work; safe to call twice."""
