"""The soak script's bookkeeping: how outcomes are judged and counted.

(The soak itself runs against a real stack in tests/test_reliability.py.)
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from benchmarks.bench.soak import ChaosEvent, SoakReport, _count, parse_args
from benchmarks.bench.soak_clients import ClientParams, RequestResult, error_kind, random_body, run_one


def result(outcome: str, end: float, cause: str = "") -> RequestResult:
    return RequestResult(
        "/v1/completions", False, 1, start=100.0, end=100.0 + end, outcome=outcome, cause=cause
    )


def test_errors_count_against_the_stack_only_outside_chaos_windows():
    report = SoakReport(60, 4, 15, kills=[ChaosEvent(rank=1, pid=7, killed_at=15.0, back_at=20.0)])
    results = [
        result("completed", 5),
        result("error", 16, "500 engine core died"),
        result("error", 21.5, "500 engine core died"),  # within the grace after it came back
        result("error", 40, "503 overloaded"),
        result("disconnected", 41, "client left"),
        result("lost", 50, "transport: ReadError"),
    ]
    _count(report, results, start=100.0, grace_s=2.0)
    assert (report.sent, report.completed, report.failed_with_error, report.disconnected, report.lost) == (
        6,
        1,
        3,
        1,
        1,
    )
    assert report.errors_outside_chaos == 1 and report.requests_outside_chaos == 4
    assert report.failures_by_cause == {"500 engine core died": 2, "503 overloaded": 1}
    assert report.lost_causes == {"transport: ReadError": 1}
    assert not report.ok  # the lost request and the error outside a window


def test_error_kinds():
    assert (
        error_kind("Engine core rank 1 stopped while serving request x: its process exited")
        == "engine core died"
    )
    assert error_kind("The server is overloaded (8 sequences admitted)") == "overloaded"
    assert error_kind("The server is shutting down; this request was stopped") == "shutting down"


def test_random_bodies_are_valid_requests():
    rng = random.Random(0)
    for _ in range(200):
        endpoint, body = random_body(rng, ClientParams(model="m", max_tokens=8))
        assert 1 <= body["max_tokens"] <= 8 and body["n"] in (1, 2)
        assert ("messages" in body) == (endpoint == "/v1/chat/completions")


def test_extra_arguments_go_to_weft_serve():
    args, serve_args = parse_args(["--duration", "5", "--", "--max-num-seqs", "8"])
    assert args.duration == 5 and serve_args == ["--max-num-seqs", "8"]


def _classify(handler) -> RequestResult:
    async def go() -> RequestResult:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://stack") as http:
            # Seed 1 draws a streaming request with n=2 first (the tests below check it).
            return await run_one(http, random.Random(1), ClientParams(model="m", disconnect_prob=0.0))

    return asyncio.run(go())


def test_streams_are_judged_by_how_they_end():
    def sse(*events: str) -> bytes:
        return b"".join(f"data: {e}\n\n".encode() for e in events)

    chunk = json.dumps(
        {"choices": [{"index": 0, "finish_reason": "length"}, {"index": 1, "finish_reason": "stop"}]}
    )
    error = json.dumps(
        {"error": {"message": "Engine core rank 0 stopped while serving request r", "code": 500}}
    )
    cases = {
        sse(chunk, "[DONE]"): ("completed", ""),
        sse(error, "[DONE]"): ("error", "500 engine core died"),
        sse(chunk): ("lost", "stream ended without [DONE] after 2 finished choice(s)"),
    }
    for body, expected in cases.items():
        got = _classify(
            lambda request, body=body: httpx.Response(
                200, content=body, headers={"content-type": "text/event-stream"}
            )
        )
        assert got.stream and (got.outcome, got.cause) == expected
        assert got.n == 2  # seed 1's request asks for two choices


def test_a_503_is_an_error_that_asks_the_client_to_wait():
    got = _classify(
        lambda request: httpx.Response(
            503,
            json={"error": {"message": "The server is overloaded", "code": 503}},
            headers={"Retry-After": "1"},
        )
    )
    assert (got.outcome, got.cause, got.retry_after_s) == ("error", "503 overloaded", 1.0)
    got = _classify(lambda request: httpx.Response(502, text="Bad gateway"))
    assert got.outcome == "lost"
