"""The real stack under faults: chaos soak, an engine core drained, the API stopped.

One ``weft serve`` with two local engine cores (a tiny random Llama, so the
test spends its time on faults, not on matrix products), in this order:

1. a chaos soak (``benchmarks.bench.soak``): random clients for 60 s while an
   engine core is SIGKILLed every 15 s (the issue's size) -- nothing lost, no
   error outside the chaos windows, no KV block leaked, every killed rank
   back and serving (the 10-minute run with ``weft bench soak`` is in
   benchmarks/results/2026-11-30-soak.md);
2. SIGTERM to one engine core during streams: every stream still completes,
   and the rank comes back;
3. SIGTERM to the API during 32 streams: each ends with its full output or
   an error event, the API exits 0 and no engine process outlives it;
4. a worker that hangs inside a step (``WEFT_TEST_FAULT_FILE``): the API sees
   the step run past ``--step-timeout`` in the rank's heartbeat, fails its
   request with a 500 and restarts the rank;
5. a step that fails to allocate memory: only the request that caused it
   fails (500), a stream batched with it finishes whole, and the rank serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import httpx
import pytest

from benchmarks.bench.soak import SoakConfig, run_soak
from benchmarks.stack import Stack
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
SHUTDOWN_TIMEOUT_S = 2.0
# The tiny model's steps take milliseconds: a step this long is hung.
STEP_TIMEOUT_S = 5.0


@contextlib.contextmanager
def running_stack(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny"))
    fault_file = tmp_path_factory.mktemp("faults") / "fault"  # absent: no fault
    stack = Stack(
        [
            "--model",
            str(model),
            "--served-model-name",
            MODEL,
            "--data-parallel-size",
            "2",
            "--num-gpu-blocks-override",
            "256",
            "--block-size",
            "16",
            "--max-model-len",
            "512",
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
            "--step-timeout",
            str(STEP_TIMEOUT_S),
        ],
        tmp_path_factory.mktemp("logs"),
        startup_timeout_s=120,
        env={"WEFT_TEST_FAULT_FILE": str(fault_file)},
    )
    stack.fault_file = fault_file
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.kill()


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory):
    with running_stack(tmp_path_factory) as stack:
        yield stack


@pytest.fixture
def stack(shared_stack):
    """The module's stack, with both ranks ready: a test that killed an engine core waits in
    its own body for the restart, and this makes sure of it whatever ran before."""
    shared_stack.wait_healthy(timeout_s=90)
    return shared_stack


@pytest.fixture
def own_stack(tmp_path_factory):
    """A stack of the test's own, for a test that stops it."""
    with running_stack(tmp_path_factory) as stack:
        yield stack


async def stream(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event | None = None) -> dict:
    """One streaming completion: its events, whether it finished, its token count."""
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if started is not None:
                    started.set()
    parsed = [json.loads(e) for e in events[:-1]]
    usage = next((e["usage"] for e in parsed if e.get("usage")), None)
    return {
        "done": events[-1:] == ["[DONE]"],
        "error": next((e["error"] for e in parsed if "error" in e), None),
        "finished": any(c.get("finish_reason") for e in parsed for c in e.get("choices", [])),
        "tokens": usage["completion_tokens"] if usage else None,
    }


def test_chaos_soak_loses_nothing_and_leaks_nothing(stack):
    config = SoakConfig(
        duration_s=60,
        chaos_interval_s=15,
        concurrency=8,
        max_tokens=32,
        warmup_s=4,
        quiesce_timeout_s=60,
        client_timeout_s=60,
    )
    report = asyncio.run(run_soak(stack, config, MODEL))
    print("\n" + report.table())
    # Kills fall due at 15, 30 and 45 s; one is skipped only if the rank killed
    # before it is not ready again yet (the soak never kills the last ready rank).
    assert len(report.kills) >= 2
    assert report.lost == 0, report.lost_causes
    assert report.errors_outside_chaos == 0, report.failures_by_cause
    assert report.quiesced and report.leaked_blocks == {0: 0, 1: 0}
    assert report.killed_ranks_serving_again
    assert report.completed > 20 and set(report.failures_by_cause) <= {"500 engine core died"}


def test_sigterm_on_an_engine_core_finishes_its_streams(stack):
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            started = [asyncio.Event() for _ in range(6)]
            streams = [asyncio.create_task(stream(client, 60, e)) for e in started]
            await asyncio.gather(*(e.wait() for e in started))
            # A rank that holds streams (usually both do; with the two engines time-sliced against
            # another test worker, one rank's three once all ended before the last stream started).
            busy = [r["rank"] for r in stack.health()["ranks"] if r["num_in_flight"] > 0]
            assert busy  # the last stream to start has most of its tokens to go
            stack.kill_engine(busy[0], signal.SIGTERM)  # a graceful stop this time
            return await asyncio.gather(*streams)

    results = asyncio.run(run())
    assert all(r["done"] and r["error"] is None and r["tokens"] == 60 for r in results), results
    health = stack.wait_healthy(timeout_s=90)  # the rank drained, exited, and was started again
    assert health["ready"] == [0, 1]


def test_sigterm_on_the_api_during_32_streams(own_stack):
    """It stops the stack: its own."""
    stack = own_stack

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=stack.url, timeout=120, limits=limits) as client:
            started = [asyncio.Event() for _ in range(32)]
            streams = [
                asyncio.create_task(stream(client, 8 if i % 2 else 400, e)) for i, e in enumerate(started)
            ]
            await asyncio.gather(*(e.wait() for e in started))
            stack.engines()  # remember the engine pids
            stack.api.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams)

    results = asyncio.run(run())
    for i, result in enumerate(results):
        assert result["done"], result  # every stream ends properly: no cut connection
        if result["error"] is None:
            assert result["finished"] and result["tokens"] == (8 if i % 2 else 400)
        else:
            assert result["error"]["code"] == 503 and "shutting down" in result["error"]["message"]
    # The shutdown timeout cut the long streams (503) while the short ones finished:
    # the API waited for work up to the timeout, not for all of it.
    assert any(r["error"] for r in results) and any(r["error"] is None for r in results)
    assert stack.api.wait(timeout=60) == 0
    assert stack.survivors() == []  # every engine core exited with the API


def test_a_worker_hung_in_a_step_is_detected_and_its_rank_restarted(stack):
    """Before: the output thread kept heartbeating while the step never ended, the rank
    stayed ready and the request waited for ever."""
    pids = {e.rank: e.pid for e in stack.engines()}
    stack.fault_file.write_text("hang")  # every worker's next step sleeps until the file changes
    try:
        response = httpx.post(
            stack.url + "/v1/completions",
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4},
            timeout=60,
        )
    finally:
        stack.fault_file.unlink()
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "hung" in message and "--step-timeout" in message, message
    health = stack.wait_healthy(timeout_s=90)  # the hung rank was killed and started again
    assert health["ready"] == [0, 1]
    assert {e.rank: e.pid for e in stack.engines()} != pids
    ok = httpx.post(
        stack.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_an_allocation_failure_fails_only_the_request_that_caused_it(stack):
    """Before: the step's error stopped the engine and failed every request on the rank.
    A step of more than 250 tokens for one request fails to allocate (injected): the long
    prompt's (361 tokens). Streams started first hold both ranks, so the long prompt shares
    a step with one: both go back to the queue (a preemption), each runs a step alone, and
    the long prompt, failing again alone, is the one that fails."""
    pids = {e.rank: e.pid for e in stack.engines()}
    preemptions = _metric(stack, "vllm:num_preemptions_total")

    async def run() -> tuple[list[dict], httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            started = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(stream(client, 200, e)) for e in started]
            await asyncio.gather(*(e.wait() for e in started))
            stack.fault_file.write_text("oom 250")
            try:
                body = {"model": MODEL, "prompt": "Once upon a time " * 90, "max_tokens": 4}
                big = await client.post("/v1/completions", json=body)
            finally:
                stack.fault_file.unlink()
            return await asyncio.gather(*streams), big

    results, big = asyncio.run(run())
    assert big.status_code == 500, big.text
    assert "could not allocate" in big.json()["error"]["message"]
    assert all(r["done"] and r["error"] is None and r["tokens"] == 200 for r in results), results
    assert _metric(stack, "vllm:num_preemptions_total") > preemptions  # it shared a step
    assert {e.rank: e.pid for e in stack.engines()} == pids  # no engine stopped
    assert stack.health()["ready"] == [0, 1]


def _metric(stack: Stack, name: str) -> float:
    """The sum of ``name``'s samples on /metrics."""
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
