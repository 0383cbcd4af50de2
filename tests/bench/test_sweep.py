"""The latency-throughput table of ``weft bench serve --sweep``: figures picked from each run's report."""

from __future__ import annotations

from benchmarks.bench.sweep import sweep_point, sweep_table


def _run(value, tok_s, ttft, itl):
    return {
        "swept_value": value,
        "completed": 64,
        "failed": 0,
        "output_throughput": tok_s,
        "ttft_ms": {"mean": 0.0, "median": ttft[0], "p90": 0.0, "p99": ttft[1]},
        "itl_ms": {"mean": 0.0, "median": itl[0], "p90": 0.0, "p99": itl[1]},
    }


def test_points_carry_the_medians_and_p99s():
    point = sweep_point(_run(64, 78.9, (22_000.0, 39_400.0), (390.0, 10_600.0)))
    assert point == {
        "value": 64,
        "completed": 64,
        "failed": 0,
        "output_tok_s": 78.9,
        "ttft_p50_ms": 22_000.0,
        "ttft_p99_ms": 39_400.0,
        "itl_p50_ms": 390.0,
        "itl_p99_ms": 10_600.0,
    }


def test_the_table_has_one_row_per_value_in_sweep_order():
    runs = [
        _run(1, 11.4, (160.0, 170.0), (88.0, 95.0)),
        _run("inf", 78.94, (22_000.4, 39_400.0), (390.0, 1e4)),
    ]
    lines = sweep_table("rates", [sweep_point(r) for r in runs]).splitlines()
    assert lines[0].split() == [
        "rate",
        "(req/s)",
        "out",
        "tok/s",
        "TTFT",
        "p50",
        "TTFT",
        "p99",
        "ITL",
        "p50",
        "ITL",
        "p99",
    ]
    assert lines[1].split() == ["1", "11.4", "160", "170", "88", "95"]
    assert lines[2].split() == ["inf", "78.9", "22000", "39400", "390", "10000"]
