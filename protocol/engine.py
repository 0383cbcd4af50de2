"""API <-> EngineCore messages: requests in, per-step output batches out.

Structs marked ``array_like`` travel as msgpack arrays: their field ORDER
is the wire contract. Append new fields at the end, with defaults.
"""

from __future__ import annotations

import enum
import time

import msgspec
import numpy as np

from protocol.kv_transfer import KVTransferParams
from protocol.pooling_params import PoolingParams
from protocol.sampling_params import SamplingParams
from protocol.structured_outputs import StructuredOutputStats


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every message on the request socket (one byte)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x04"
    # The API routes nothing more to this engine: sent in answer to its
    # EngineDraining notice, so every ADD sent before it is already queued
    # at the engine when this arrives (one ordered link).
    DRAIN = b"\x05"


class UtilityMethod(enum.StrEnum):
    """Engine-wide operations the API may call on every rank (UTILITY frames)."""

    # Forget every cached prefix; refused (False) while any KV block is in use.
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    # Stop scheduling: requests stay where they are (queued, or holding their
    # blocks) and new ones queue, until RESUME. Answers True.
    PAUSE = "pause"
    RESUME = "resume"


class UtilityRequest(msgspec.Struct, array_like=True, frozen=True):
    """Payload of a UTILITY frame; answered by an ``EngineCoreOutputs`` carrying a ``UtilityResult``."""

    call_id: int  # the API's, echoed back so it can match the answer
    method: UtilityMethod


class UtilityResult(msgspec.Struct, array_like=True, frozen=True):
    call_id: int
    ok: bool  # what the method answered (reset: whether the cache was reset)
    error: str | None = None  # the call itself failed (a bug, not a refusal)


class FinishReason(enum.IntEnum):
    """Why a request ended; an int on the wire, vLLM's words in ``str()``."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    # Disaggregated prefill/decode: what the proxy asks of this engine.
    kv_transfer_params: KVTransferParams | None = None
    # Sticky-session key for the API's balancer (x-session-id or the OpenAI user); engines ignore it.
    session_key: str | None = None
    # Set for an embeddings request: prompt-only, finished with its pooled hidden state
    # (``sampling_params`` is then unused).
    pooling_params: PoolingParams | None = None


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token in the full distribution, 1 = most likely


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    type: EngineCoreEventType
    timestamp: float  # engine-process monotonic clock; compare only with each other


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # One entry per prompt position; the first is None (no context to predict it).
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None
    # Set when the request failed on its own (bad input found late); the
    # engine itself is fine.
    error: str | None = None
    # On a finished request: what another engine needs to take over its KV.
    kv_transfer_params: KVTransferParams | None = None
    # With ``error``: the engine failed, not the request's input (a 500, not a 400).
    error_is_internal: bool = False
    # The engine's monotonic clock when the step that made this output ended
    # (first/last token times of the request metrics), and the rank that made
    # it: per-request metrics carry vLLM's `engine` label, and the API's
    # consumer of one request sees single outputs, not their batch.
    timestamp: float = 0.0
    engine_index: int = 0
    # A finished pooling request's vector: float32 [hidden_size], a raw frame on the wire.
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up since the previous stats
    prefix_cache_hits: int = 0  # tokens found since the previous stats
    num_preemptions: int = 0  # preemptions since the previous stats
    step_counter: int = 0
    # Speculative decoding, since the previous stats: requests that verified
    # drafts, draft tokens verified, drafts accepted, and accepted per draft
    # position (index 0: the first draft token).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # Structured outputs: totals since the engine started; None before any.
    structured_outputs: StructuredOutputStats | None = None
    # Malformed input frames the engine dropped since it started (a running
    # total, not a delta: a lost stats message loses nothing).
    num_dropped_frames: int = 0
    # Disaggregated prefill/decode, since the previous stats: prompt tokens
    # offered by a KV connector, and those loaded from it instead of computed.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Tokens scheduled per engine step, since the previous stats, counted
    # into ITERATION_TOKENS_BUCKETS (one count per bucket, then +Inf), and
    # their sum: vllm:iteration_tokens_total.
    iteration_tokens_counts: list[int] = []
    iteration_tokens_sum: int = 0
    # Seconds the engine has spent in the step it is running now (0 between
    # steps), as its output thread saw it when it sent these stats: a
    # heartbeat during a stuck step says so (``step_counter`` is the last
    # step that finished). The API marks a rank hung past ``--step-timeout``.
    step_elapsed_s: float = 0.0


# Upper bounds of the tokens-per-step histogram (vLLM's buckets); the engine
# counts into them and the API exposes them, so both read this list.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# The SchedulerStats fields that count since the previous stats (ints, or
# lists added element-wise). Declared once: the API sums exactly these into
# its running totals, and a heartbeat repeating old stats zeroes them.
SCHEDULER_STATS_DELTAS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "iteration_tokens_counts",
    "iteration_tokens_sum",
)


def without_deltas(stats: SchedulerStats) -> SchedulerStats:
    """``stats`` with every delta zeroed: what may be sent again without counting twice."""
    return msgspec.structs.replace(
        stats,
        **{name: [] if isinstance(getattr(stats, name), list) else 0 for name in SCHEDULER_STATS_DELTAS},
    )


def has_deltas(stats: SchedulerStats) -> bool:
    """True when ``stats`` counts something new (it must reach the API)."""
    return any(getattr(stats, name) for name in SCHEDULER_STATS_DELTAS)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    finished_requests: list[str] | None = None
    # The answer to a UTILITY frame (sent alone, without outputs).
    utility_output: UtilityResult | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()
