"""Serving metric arithmetic on synthetic timestamps, against values worked out by hand."""

from __future__ import annotations

import pytest

from benchmarks.bench.metrics import RequestRecord, parse_goodput, percentile, summarize

# Request A: sent at 0, four one-token chunks, stream ends at 0.32 s.
A = RequestRecord(prompt_tokens=10, output_tokens=4, sent=0.0, chunk_times=[0.1, 0.15, 0.25, 0.3], ended=0.32)
# Request B: one token, sent at 1.0, its only chunk at 1.5.
B = RequestRecord(prompt_tokens=5, output_tokens=1, sent=1.0, chunk_times=[1.5], ended=1.5)
# Request C: failed.
C = RequestRecord(prompt_tokens=7, output_tokens=0, sent=0.5, error="HTTP 500")


def test_per_request_figures() -> None:
    assert A.ttft == pytest.approx(0.1)
    assert A.e2el == pytest.approx(0.32)
    assert A.tpot == pytest.approx((0.32 - 0.1) / 3)  # (E2E - TTFT) / (tokens - 1)
    assert A.itls == pytest.approx([0.05, 0.1, 0.05])
    assert B.tpot is None and B.itls == []
    assert not C.ok and A.ok


def test_summary_matches_hand_computed_values() -> None:
    s = summarize([A, B, C], duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (15, 5)  # the failed request is not counted
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(10.0)
    assert s["ttft_ms"] == pytest.approx({"mean": 300, "median": 300, "p90": 460, "p99": 496})
    assert s["tpot_ms"] == pytest.approx({k: 220 / 3 for k in ("mean", "median", "p90", "p99")})
    assert s["itl_ms"] == pytest.approx({"mean": 200 / 3, "median": 50, "p90": 90, "p99": 99})
    assert s["e2el_ms"] == pytest.approx({"mean": 410, "median": 410, "p90": 482, "p99": 498.2})
    assert s["errors"] == ["HTTP 500"]
    assert "request_goodput" not in s


@pytest.mark.parametrize(
    "slos, good",
    [
        (["ttft:200"], 1),  # B's 500 ms TTFT misses
        (["tpot:50"], 1),  # A's 73 ms TPOT misses; B has no TPOT to miss
        (["e2el:400", "tpot:80"], 1),  # A meets both, B's 500 ms E2E misses
        (["ttft:600", "tpot:80", "e2el:600"], 2),
        (["ttft:50"], 0),
    ],
)
def test_goodput(slos: list[str], good: int) -> None:
    s = summarize([A, B, C], duration_s=2.0, slos=parse_goodput(slos))
    assert s["good_requests"] == good
    assert s["request_goodput"] == pytest.approx(good / 2.0)


def test_parse_goodput_converts_ms_and_refuses_bad_input() -> None:
    assert parse_goodput(["ttft:500", "e2el:1500"]) == {"ttft": 0.5, "e2el": 1.5}
    assert parse_goodput(None) == {}
    for bad in ("ttft", "latency:5", "tpot:abc", "ttft:-1"):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0
