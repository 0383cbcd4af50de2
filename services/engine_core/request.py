"""One request's state inside the engine core.

A request's progress is a single number, ``num_computed_tokens``: how many
of its tokens (prompt, then outputs) already have KV in the cache. Prefill
chunks, prefix-cache hits and decodes all just move that number towards
``num_tokens``.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
    SamplingParams,
)
from protocol.kv_transfer import KVTransferParams

if TYPE_CHECKING:
    from services.engine_core.structured_output.request_state import StructuredOutputRequest

# (request) -> hashes of the request's full blocks that are not hashed yet.
BlockHasher = Callable[["Request"], list[bytes]]


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # structured output: its grammar is compiling
    WAITING_FOR_REMOTE_KVS = enum.auto()  # its prompt's KV is loading from another engine
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


# Every Request this process makes takes the next number: its place in arrival order.
_ARRIVAL_ORDER = itertools.count()


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        block_hasher: BlockHasher | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time  # the client's wall clock: reported, never used to order
        # The engine's own arrival order and clock: queues order by these, so a
        # wall clock stepped back (or a front end's skewed one) cannot let a new
        # arrival jump the queue.
        self.arrival_order = next(_ARRIVAL_ORDER)
        self.arrival_s = time.monotonic()
        self.priority = priority
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        # Disaggregated prefill/decode: what the proxy asked of this engine.
        self.kv_transfer_params = kv_transfer_params
        # An embeddings request: prompt-only, finished by its pooled vector, never sampled.
        self.pooling_params = pooling_params

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # Prompt then outputs, kept alongside output_token_ids so neither
        # the hasher nor the scheduler has to concatenate every step.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Draft tokens (speculative decoding) to verify at the next step; their
        # KV is scheduled but they are not tokens of the request until accepted.
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens sampled by steps in flight, not known yet
        # (the worker feeds them as the next step's inputs).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Prompt positions whose logprobs the front end already has.
        self.num_prompt_logprobs_sent = 0
        # Events not yet reported to the front end (queue time, TTFT, ITL).
        self.events: list[EngineCoreEvent] = []
        # Structured outputs: the grammar, set by the StructuredOutputManager.
        self.structured_output: StructuredOutputRequest | None = None
        self.error: str | None = None  # why a FINISHED_ERROR request failed
        self.error_is_internal = False  # the engine failed it, not its input
        self.prefix_lookup_counted = False  # its first prefix-cache lookup is in the stats
        # Steps that failed to allocate memory with this request in them
        # (Scheduler.fail_step); a suspect runs its next step alone.
        self.num_failed_steps = 0
        self.suspect = False

        self._block_hasher = block_hasher
        self.block_hashes: list[bytes] = []
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, block_hasher: BlockHasher | None) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            arrival_time=req.arrival_time,
            priority=req.priority,
            eos_token_id=req.eos_token_id,
            cache_salt=req.cache_salt,
            block_hasher=block_hasher,
            kv_transfer_params=req.kv_transfer_params,
            pooling_params=req.pooling_params,
        )

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self.all_token_ids.append(token_id)
        if self._block_hasher is not None:
            # Blocks that the new tokens filled become shareable.
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def skips_prefix_cache(self) -> bool:
        """Positions served from the cache have K/V but neither logits nor hidden states: a request
        that needs those at every prompt position (prompt logprobs, mean pooling) computes them all."""
        if self.pooling_params is not None:
            return self.pooling_params.needs_every_position
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent(event_type, time.monotonic()))

    def take_events(self) -> list[EngineCoreEvent] | None:
        events, self.events = self.events, []
        return events or None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
