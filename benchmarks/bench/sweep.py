"""A latency-throughput curve from ``weft bench serve --sweep`` runs: the
figures of each point, and the table printed after the sweep. Pure arithmetic
on the client's reports (``metrics.summarize``)."""

from __future__ import annotations

from typing import Any

_COLUMNS = (
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99", "{:.0f}"),
    ("itl_p50_ms", "ITL p50", "{:.0f}"),
    ("itl_p99_ms", "ITL p99", "{:.0f}"),
)


def sweep_point(run: dict[str, Any]) -> dict[str, Any]:
    """One point of the curve: output tokens/s and TTFT / ITL medians and p99s (ms)."""
    return {
        "value": run["swept_value"],
        "completed": run["completed"],
        "failed": run["failed"],
        "output_tok_s": run["output_throughput"],
        "ttft_p50_ms": run["ttft_ms"]["median"],
        "ttft_p99_ms": run["ttft_ms"]["p99"],
        "itl_p50_ms": run["itl_ms"]["median"],
        "itl_p99_ms": run["itl_ms"]["p99"],
    }


def sweep_table(kind: str, points: list[dict[str, Any]]) -> str:
    """The curve as a text table, one row per swept value (latencies in ms)."""
    label = "concurrency" if kind == "concurrencies" else "rate (req/s)"
    header = f"{label:>12}" + "".join(f"{title:>11}" for _, title, _ in _COLUMNS)
    rows = [
        f"{point['value']!s:>12}" + "".join(f"{fmt.format(point[key]):>11}" for key, _, fmt in _COLUMNS)
        for point in points
    ]
    return "\n".join([header, *rows])
