"""What the API's routes need from the engine cores, and nothing more.

The routes code against ``EngineClient``; the real implementation
(``services.api.dp_client.DPLBEngineClient``) balances requests over the
data-parallel engine-core processes on ZMQ sockets, and tests may plug in a
fake. Torch-free, like the whole API process.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from protocol import EngineCoreOutput, EngineCoreRequest
from protocol.structured_outputs import StructuredOutputStats


class EngineDeadError(RuntimeError):
    """The engine core holding a request died or stopped answering; the
    request failed (the API stays up and routes new requests elsewhere)."""


class EngineNotReadyError(RuntimeError):
    """No engine core is ready to take requests (starting up, or all dead)."""


@dataclass
class RankStats:
    """What the API knows of one data-parallel rank."""

    rank: int
    state: str = "waiting"  # "waiting", "ready", "draining" (finishes, gets nothing new), "dead"
    num_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    # Running totals, summed over every stats message the rank sent.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_routed: int = 0  # requests the API sent to this rank, ever
    in_flight: set[str] = field(default_factory=set)  # request ids routed here, not finished
    num_dropped_frames: int = 0  # malformed input frames the engine dropped (its running total)
    # Speculative decoding running totals (see SchedulerStats).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Structured outputs: the rank's totals as it last reported them.
    structured_outputs: StructuredOutputStats | None = None
    # Disaggregated prefill/decode running totals: prompt tokens a KV
    # connector offered, and those loaded from it instead of computed.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


def add_spec_decode_stats(stats: RankStats, new) -> None:
    """Add one ``SchedulerStats``' speculative-decoding deltas to a rank's totals."""
    stats.spec_decode_num_drafts += new.spec_decode_num_drafts
    stats.spec_decode_num_draft_tokens += new.spec_decode_num_draft_tokens
    stats.spec_decode_num_accepted_tokens += new.spec_decode_num_accepted_tokens
    totals = stats.spec_decode_num_accepted_tokens_per_pos
    for position, count in enumerate(new.spec_decode_num_accepted_tokens_per_pos):
        if position == len(totals):
            totals.append(0)
        totals[position] += count


class EngineClient(ABC):
    @abstractmethod
    async def start(self) -> None:
        """Open the sockets and start the background tasks (returns at once;
        ranks become ready later)."""

    @abstractmethod
    def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Send ``request`` to the least-loaded ready rank and yield its
        outputs until one is finished. Raises ``EngineNotReadyError`` when no
        rank is ready and ``EngineDeadError`` if the rank dies meanwhile.
        Closing the iterator early (client gone) aborts the request."""

    @abstractmethod
    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests on the ranks that hold them; unknown ids are ignored."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """True when every rank is ready (/health 200)."""

    @abstractmethod
    def rank_stats(self) -> dict[int, RankStats]:
        """Per-rank state and load, for /health and /metrics."""

    def dropped_frames(self) -> dict[str, int]:
        """Malformed frames the client dropped, by socket (for /metrics)."""
        return {}

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop background tasks, tell local engines to stop, close sockets."""
