"""The engine core's periodic log line: load, KV usage, and speculative decoding.

Fed every step's ``SchedulerStats`` (whose counters are deltas since the
previous step); every ``interval_s`` it logs one line for the interval that
just ended. It also keeps the speculative-decoding totals since start, which
the benchmarks report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import SchedulerStats

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


@dataclass
class SpecDecodingCounts:
    num_drafts: int = 0  # request-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, stats: SchedulerStats) -> None:
        self.num_drafts += stats.spec_decode_num_drafts
        self.num_draft_tokens += stats.spec_decode_num_draft_tokens
        self.num_accepted_tokens += stats.spec_decode_num_accepted_tokens
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        if len(per_pos) > len(self.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
        for position, count in enumerate(per_pos):
            self.accepted_per_pos[position] += count

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over verified draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per drafted request-step: the accepted drafts plus the one sampled token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position_rates(self) -> list[float]:
        return [count / self.num_drafts for count in self.accepted_per_pos] if self.num_drafts else []

    def summary(self) -> str:
        rates = ", ".join(f"{rate:.3f}" for rate in self.per_position_rates())
        return (
            f"spec decode: acceptance rate {self.acceptance_rate:.1%}, mean accepted length "
            f"{self.mean_accepted_length:.2f}, {self.num_draft_tokens} draft tokens in "
            f"{self.num_drafts} drafts, per-position acceptance [{rates}]"
        )


class EngineStatsLogger:
    def __init__(
        self,
        engine_index: int,
        spec_decode: bool,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine_index = engine_index
        self.spec_decode = spec_decode
        self.interval_s = interval_s
        self._clock = clock
        self._last_log = clock()
        self._num_generated = 0  # tokens emitted in the current interval
        self._interval = SpecDecodingCounts()
        self.spec_totals = SpecDecodingCounts()  # since start

    def observe(self, stats: SchedulerStats | None, num_generated: int) -> None:
        """One step's stats and the number of tokens it emitted."""
        if stats is None:
            return
        self._num_generated += num_generated
        self._interval.add(stats)
        self.spec_totals.add(stats)
        now = self._clock()
        if now - self._last_log >= self.interval_s:
            logger.info(self.line(stats, now - self._last_log))
            self._last_log = now
            self._num_generated = 0
            self._interval = SpecDecodingCounts()

    def line(self, stats: SchedulerStats, elapsed_s: float) -> str:
        text = (
            f"Engine {self.engine_index:03d}: running {stats.num_running_reqs}, waiting "
            f"{stats.num_waiting_reqs}, KV cache {stats.kv_cache_usage:.1%}, generation "
            f"{self._num_generated / max(elapsed_s, 1e-9):.1f} tokens/s"
        )
        if self.spec_decode:
            text += "; " + self._interval.summary()
        return text
