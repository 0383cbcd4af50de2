"""Management endpoints and vLLM's metric families through ``weft serve``.

One real stack (the default SmolLM2-135M-Instruct, one engine core, an API
key, two served names) and the official ``openai`` client. What is observed
is what a user sees: ``cached_tokens`` going to 0 after /reset_prefix_cache,
a request that makes no progress while generation is paused and finishes,
with the same text as an unpaused run, after /resume, and /metrics.

"No progress while paused" is read from the engine's own tokens-per-step
histogram: the engine answers the pause after every earlier step's stats on
the same ordered socket, so the count read once the pause returns is final,
and any step run while paused would raise it.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from benchmarks.stack import Stack
from tests.polling import wait_until
from tests.test_monitoring import dashboard_metric_names, served_sample_names

pytestmark = pytest.mark.slow

KEY = "mgmt-key"
NAMES = ["smol", "smol-alias"]
ADMIN_KEY = "mgmt-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the management POSTs take only the admin key
# Two full KV blocks (38 tokens), so a repeat hits the prefix cache.
LONG_PROMPT = (
    "The history of the city begins with a small settlement on the river, where traders met "
    "to exchange grain, salt and cloth. Over the centuries it grew into a market town, then a "
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(
        [
            "--served-model-name",
            *NAMES,
            "--api-key",
            KEY,
            "--admin-api-key",
            ADMIN_KEY,
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--num-threads",
            "1",
            "--data-parallel-size",
            "1",
            # A fixed pool instead of profiling a 2048-token step at start-up.
            "--num-gpu-blocks-override",
            "128",
            "--block-size",
            "16",
        ],
        tmp_path_factory.mktemp("logs"),
    )
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.kill()


@pytest.fixture(autouse=True)
async def resumed(stack):
    """Each test starts and leaves the stack serving, whatever happened in between."""
    yield
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        assert (await http.post("/resume", headers=AUTH)).status_code == 200


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
async def http(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
        yield c


async def _complete(client, prompt: str = LONG_PROMPT, max_tokens: int = 2, **extra):
    return await client.completions.create(
        model=NAMES[0], prompt=prompt, max_tokens=max_tokens, temperature=0.0, extra_body=extra or None
    )


async def _engine_steps(http) -> float:
    text = (await http.get("/metrics")).text
    found = re.search(r'^vllm:iteration_tokens_total_count\{engine="0".*\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1))


async def test_reset_prefix_cache_sends_cached_tokens_to_zero(client, http):
    await _complete(client)
    repeat = await _complete(client)
    assert repeat.usage.prompt_tokens_details.cached_tokens == 32  # both full blocks
    assert (await http.post("/reset_prefix_cache")).status_code == 401  # behind --admin-api-key
    tenant = {"Authorization": f"Bearer {KEY}"}
    assert (await http.post("/reset_prefix_cache", headers=tenant)).status_code == 401
    response = await http.post("/reset_prefix_cache", headers=AUTH)
    assert response.status_code == 200 and response.json() == {"reset": True, "ranks": [0]}
    after = await _complete(client)
    assert after.usage.prompt_tokens_details.cached_tokens == 0


async def test_paused_request_makes_no_progress_and_finishes_after_resume(client, http):
    expected = (await _complete(client, "Once upon a time", 24, ignore_eos=True)).choices[0].text
    stream = await client.completions.create(
        model=NAMES[0],
        prompt="Once upon a time",
        max_tokens=24,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [await anext(stream)]  # it runs
    paused = await http.post("/pause", params={"mode": "keep", "clear_cache": "false"}, headers=AUTH)
    assert paused.json() == {"is_paused": True, "mode": "keep", "cache_cleared": None}
    steps = await _engine_steps(http)
    held = asyncio.ensure_future(_complete(client, "A new request", 2))
    load = await _wait_load(http, 2)  # the kept stream and the held request
    health = (await http.get("/health")).json()
    [rank] = health["ranks"]
    assert rank["num_running"] == 1 and rank["num_in_flight"] == 1  # held before the engine
    assert rank["num_free_blocks"] < rank["num_blocks"] - 1  # the kept request keeps its KV
    assert (await http.post("/reset_prefix_cache", headers=AUTH)).status_code == 409
    assert not held.done() and load == {"server_load": 2}
    assert await _engine_steps(http) == steps  # not one step while paused
    assert (await http.post("/resume", headers=AUTH)).json() == {"is_paused": False}
    chunks += [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert (await asyncio.wait_for(held, 120)).choices[0].finish_reason == "length"


async def _wait_load(http, n: int) -> dict:
    load = {}

    async def poll():
        nonlocal load
        load = (await http.get("/load")).json()
        return load["server_load"] == n

    await wait_until(poll, 30, f"/load to reach {n}")
    return load


async def test_pause_abort_ends_running_requests_and_clears_the_cache(client, http):
    stream = await client.completions.create(
        model=NAMES[0],
        prompt=LONG_PROMPT,
        max_tokens=200,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    await anext(stream)
    response = await http.post("/pause", headers=AUTH)  # vLLM's default: abort, then clear the cache
    assert response.json() == {"is_paused": True, "mode": "abort", "cache_cleared": True}
    rest = [chunk async for chunk in stream]
    assert rest[-1].choices[0].finish_reason == "abort"
    assert (await http.get("/is_paused")).json() == {"is_paused": True}
    assert (await http.post("/resume", headers=AUTH)).status_code == 200
    assert (await _complete(client)).usage.prompt_tokens_details.cached_tokens == 0


async def test_models_by_name_and_aliases(client):
    assert [m.id for m in (await client.models.list()).data] == NAMES
    assert (await client.models.retrieve("smol-alias")).id == "smol-alias"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")
    response = await client.completions.create(model="smol-alias", prompt="Hi", max_tokens=1)
    assert response.model == NAMES[0]  # the first name is the one reported


async def test_metrics_serve_what_the_dashboard_queries(client, http):
    await _complete(client, "Hello", 4)
    text = (await http.get("/metrics")).text
    assert not dashboard_metric_names() - served_sample_names(text)
    phases = {}
    for name in ("prefill", "decode", "inference"):
        pattern = rf'^vllm:request_{name}_time_seconds_sum\{{engine="0".*\}} (\S+)$'
        found = re.search(pattern, text, re.MULTILINE)
        phases[name] = float(found.group(1))
    assert phases["prefill"] > 0 and phases["decode"] > 0
    # inference = prefill + decode for every request (the engine's clock, same timestamps).
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], rel=1e-6)
