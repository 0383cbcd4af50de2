"""Scheduler <-> worker messages: the pure-data seam of one engine step.

The scheduler imports no torch; the worker keeps a persistent batch that
each ``SchedulerOutput`` updates incrementally. Field order is the wire
contract (``array_like``): append new fields at the end, with defaults.
"""

from __future__ import annotations

import msgspec
import numpy as np

from protocol.engine import TokenLogprobs
from protocol.kv_transfer import KVConnectorMetadata
from protocol.pooling_params import PoolingParams
from protocol.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the worker has not seen, or sees again after preemption.

    A preempted request is dropped by the worker and comes back as new, with
    the tokens it had already generated in ``output_token_ids`` (recompute).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []
    # Block tables of KV cache groups 1.. (``protocol.kv_cache_groups``); ``block_ids`` is group 0's.
    group_block_ids: list[list[int]] = []
    # A pooling (embeddings) request: the worker pools its prompt's hidden states, never samples it.
    pooling_params: PoolingParams | None = None


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """Columnar diff for requests the worker already holds."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []  # appended to each block table
    num_computed_tokens: list[int] = []
    # Per request, the blocks appended to the tables of KV cache groups 1.. (empty with one group).
    new_group_block_ids: list[list[list[int]]] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Finished or preempted since the previous step: the worker drops them.
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    # Draft tokens to verify this step (speculative decoding).
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Structured outputs: the constrained requests that sample this step, and
    # their packed token masks (int32 [rows, ceil(vocab / 32)], bit j of word
    # w allows token 32 * w + j). Each request has 1 + len(its scheduled
    # drafts) consecutive rows, in the order of structured_output_request_ids.
    structured_output_request_ids: list[str] = []
    grammar_bitmask: np.ndarray | None = None
    # Disaggregated prefill/decode: the KV blocks the worker saves and loads.
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced, per scheduled request (in ``req_ids`` order).

    ``sampled_token_ids[i]`` is empty for a request still mid-prefill.
    ``logprobs[i]`` has one entry per sampled token when the request asked
    for logprobs, else is empty. ``prompt_logprobs`` holds, per request that
    asked, the entries for the prompt positions computed this step.
    """

    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: list[list[TokenLogprobs]] = []
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    # Speculative decoding: per request (``req_ids`` order), the draft tokens
    # proposed for its NEXT step; empty where none were found.
    spec_token_ids: list[list[int]] = []
    # Disaggregated prefill/decode: requests whose KV blocks the worker has
    # finished saving (the scheduler may free them now), and requests whose
    # KV load ended, with how many of the asked blocks (a prefix) arrived
    # intact; the rest of such a prompt is computed.
    finished_sending: list[str] = []
    finished_recving: dict[str, int] = {}
    # Pooling requests whose last prompt token ran this step, and their pooled vectors
    # (float32 [len(pooled_req_ids), hidden_size], one raw frame on the wire), row i for id i.
    pooled_req_ids: list[str] = []
    pooled: np.ndarray | None = None
