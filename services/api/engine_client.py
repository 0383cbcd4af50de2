"""What the API's routes need from the engine cores, and nothing more.

The routes code against ``EngineClient``; the real implementation
(``services.api.dp_client.DPLBEngineClient``) balances requests over the
data-parallel engine-core processes on ZMQ sockets, and tests may plug in a
fake. Torch-free, like the whole API process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from protocol.engine import SCHEDULER_STATS_DELTAS, UtilityMethod
from protocol.structured_outputs import StructuredOutputStats

# --step-timeout: one engine step running longer is a hung rank. A step is one
# forward over at most max_num_batched_tokens tokens: seconds even for a large
# prefill on a few CPU cores, so minutes means a worker or collective that never returns.
DEFAULT_STEP_TIMEOUT_S = 300.0


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
    # Every stats delta the rank sent (SCHEDULER_STATS_DELTAS), summed: the
    # running totals behind the counters on /metrics. Its other fields are unused.
    totals: SchedulerStats = field(default_factory=SchedulerStats)
    num_routed: int = 0  # requests the API sent to this rank, ever
    in_flight: set[str] = field(default_factory=set)  # request ids routed here, not finished
    num_dropped_frames: int = 0  # malformed input frames the engine dropped (its running total)
    # Structured outputs: the rank's totals as it last reported them.
    structured_outputs: StructuredOutputStats | None = None


def add_deltas(stats: RankStats, new: SchedulerStats, prefix: str = "") -> None:
    """Add ``new``'s deltas (those named ``prefix...``) to a rank's totals; lists element-wise."""
    for name in SCHEDULER_STATS_DELTAS:
        if not name.startswith(prefix):
            continue
        value = getattr(new, name)
        if not isinstance(value, list):
            setattr(stats.totals, name, getattr(stats.totals, name) + value)
            continue
        totals = getattr(stats.totals, name)
        totals.extend([0] * (len(value) - len(totals)))
        for index, count in enumerate(value):
            totals[index] += count


def add_spec_decode_stats(stats: RankStats, new: SchedulerStats) -> None:
    """Add one ``SchedulerStats``' speculative-decoding deltas to a rank's totals."""
    add_deltas(stats, new, prefix="spec_decode_")


class EngineClient(ABC):
    @abstractmethod
    async def start(self) -> None:
        """Open the sockets and start the background tasks (returns at once;
        ranks become ready later)."""

    @abstractmethod
    def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        """Send ``request`` to the least-loaded ready rank and yield its
        outputs until one is finished. Raises ``EngineNotReadyError`` when no
        rank is ready and ``EngineDeadError`` if the rank dies meanwhile.
        Closing the generator before its last output (a stop string, client
        gone) aborts the request: its cleanup is the one owner of ABORT."""

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

    @property
    def max_model_len(self) -> int | None:
        """The context the engines serve, as they reported it when ready (they may have lowered the
        config's to what their KV cache holds); None before any did."""
        return None

    @property
    def start_failure(self) -> str | None:
        """Why an engine this API started failed before it was ever ready (the server then stops
        with an error instead of restarting it); None while none did."""
        return None

    async def call_utility(self, method: UtilityMethod) -> dict[int, bool]:
        """Call ``method`` on every live rank and return each rank's answer.
        Raises ``EngineNotReadyError`` when no rank is live, ``EngineDeadError``
        when one dies before answering, ``RuntimeError`` when the call failed."""
        raise NotImplementedError(f"{type(self).__name__} has no utility calls.")

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop background tasks, tell local engines to stop, close sockets."""
