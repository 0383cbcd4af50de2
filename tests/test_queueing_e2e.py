"""Requests past the running batch wait in the engine's queue; only past
``--max-waiting-requests`` does the API answer 503 with ``Retry-After``.

Two ``weft serve`` on the default model: one with ``--max-num-seqs 16`` and
the default waiting bound takes a burst of 256 concurrent requests, all
answered (most of them queued in the engine first); one with
``--max-num-seqs 2 --max-waiting-requests 8`` holds at most 10 at once, so
a burst of 30 long ones gets some 503s.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from benchmarks.stack import Stack
from services import model_files

pytestmark = pytest.mark.slow

BURST = 256
DEADLINE_S = 600


def serve(tmp_path_factory, name: str, *extra: str):
    stack = Stack(
        [
            "--model",
            str(model_files.resolve(None).weights),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--num-threads",
            "1",
            *extra,
        ],
        tmp_path_factory.mktemp(name),
        startup_timeout_s=240,
    )
    try:
        stack.wait_healthy()
    except BaseException:
        stack.kill()
        raise
    return stack


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory):
    stack = serve(tmp_path_factory, "queueing-wide", "--max-num-seqs", "16")
    yield stack
    stack.kill()


@pytest.fixture(scope="module")
def narrow_server(tmp_path_factory):
    stack = serve(tmp_path_factory, "queueing-narrow", "--max-num-seqs", "2", "--max-waiting-requests", "8")
    yield stack
    stack.kill()


async def burst(url: str, count: int, max_tokens: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=DEADLINE_S) as client:
        body = {"prompt": "Count to ten:", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        sends = [client.post("/v1/completions", json=body) for _ in range(count)]
        return await asyncio.wait_for(asyncio.gather(*sends), DEADLINE_S)


async def most_waiting(url: str, done: asyncio.Event) -> int:
    """The largest vllm:num_requests_waiting /metrics showed until ``done``."""
    most = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not done.is_set():
            text = (await client.get("/metrics")).text
            for value in re.findall(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M):
                most = max(most, int(float(value)))
            try:
                await asyncio.wait_for(done.wait(), 0.5)  # the next look, unless the burst is over
            except TimeoutError:
                pass
    return most


async def test_a_burst_past_the_running_batch_waits_in_the_engine_and_is_all_answered(wide_server):
    done = asyncio.Event()
    watcher = asyncio.ensure_future(most_waiting(wide_server.url, done))
    try:
        responses = await burst(wide_server.url, BURST, max_tokens=4)
    finally:
        done.set()
        waiting = await watcher
    assert [r.status_code for r in responses] == [200] * BURST
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)
    assert waiting > 0  # the engine queued what its 16 running slots could not take


async def test_past_the_waiting_bound_the_api_answers_503_with_retry_after(narrow_server):
    responses = await burst(narrow_server.url, 30, max_tokens=64)
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 503}
    assert codes.count(200) >= 10  # 2 running + 8 waiting were admitted at once
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1" and "overloaded" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 64
