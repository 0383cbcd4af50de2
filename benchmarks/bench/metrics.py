"""Serving metrics from per-request timestamps: pure arithmetic, no I/O.

The client (``serve_client``) records, for each request, when it was sent,
when each streamed chunk of output arrived and when the stream ended; this
module turns those records into the figures ``weft bench serve`` reports.
Definitions (vLLM's, so the numbers compare):

- TTFT: first chunk's arrival - send time.
- E2EL: end of stream - send time.
- TPOT: (E2EL - TTFT) / (output tokens - 1); undefined for one-token outputs.
- ITL: gaps between consecutive chunks (a chunk may hold several tokens).
- goodput: requests per second that met every given SLO.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request (times in seconds, one clock)."""

    prompt_tokens: int
    output_tokens: int
    sent: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    ended: float = 0.0
    error: str | None = None  # set when the request failed

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.ended - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:])]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (ms in, seconds out)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}; got {item!r}."
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of milliseconds.") from None
        if ms <= 0:
            raise ValueError(f"--goodput {name} must be positive, got {value}.")
        slos[name] = ms / 1000
    return slos


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    assert values, "callers skip empty series"
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe_ms(values: list[float]) -> dict[str, float]:
    """Mean, median, p90 and p99 of seconds, in milliseconds (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ms = [v * 1000 for v in values]
    stats = {"mean": sum(ms) / len(ms)}
    for q in PERCENTILES:
        stats["median" if q == 50 else f"p{q}"] = percentile(ms, q)
    return stats


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    for name, limit in slos.items():
        value = getattr(record, name)
        # A one-token output has no TPOT: nothing to miss.
        if value is not None and value > limit:
            return False
    return True


def summarize(
    records: list[RequestRecord], duration_s: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """The report of one benchmark run of ``duration_s`` wall seconds."""
    assert duration_s > 0, "a run takes some time"
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": describe_ms([r.ttft for r in done]),
        "tpot_ms": describe_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": describe_ms([gap for r in done for gap in r.itls]),
        "e2el_ms": describe_ms([r.e2el for r in done]),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in done)
        summary["goodput_slos_ms"] = {name: limit * 1000 for name, limit in slos.items()}
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration_s
    return summary
