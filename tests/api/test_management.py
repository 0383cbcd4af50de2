"""Management routes on the in-process app: /load, /pause, /resume, /is_paused,
/reset_prefix_cache, /v1/models/{model}, several served model names, and
which of them need the API key. (The engines' side is tested end to end in
tests/test_management_e2e.py.)"""

from __future__ import annotations

import asyncio

import pytest

from protocol.engine import UtilityMethod
from services.api.engine_client import EngineNotReadyError
from services.api.limits import ServingLimits
from tests.api.fake_engine_client import (
    MODEL_NAME,
    FakeEngineClient,
    http_client,
    make_app,
)
from tests.polling import wait_until

KEY = "secret"
ADMIN = "admin-secret"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def served():
    app, engine = make_app(admin_api_key=ADMIN)
    return http_client(app, headers=ADMIN_AUTH), engine, app.state.engine_client


async def _complete(client, max_tokens: int = 3):
    return await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": max_tokens})


async def test_load_counts_requests_in_flight(served):
    client, engine, _gate = served
    assert (await client.get("/load")).json() == {"server_load": 0}
    engine.hang_after = 1
    hanging = asyncio.ensure_future(_complete(client))
    await asyncio.wait_for(engine.hanging.wait(), 10)
    assert (await client.get("/load")).json() == {"server_load": 1}
    hanging.cancel()
    await asyncio.gather(hanging, return_exceptions=True)
    await wait_until(lambda: engine.closed_early, 10, "the hung request to be closed")


async def test_pause_keep_holds_new_requests_until_resume(served):
    client, engine, gate = served
    response = await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    assert response.status_code == 200
    assert response.json() == {"is_paused": True, "mode": "keep", "cache_cleared": None}
    assert engine.utility_calls == [UtilityMethod.PAUSE]
    assert (await client.get("/is_paused")).json() == {"is_paused": True}
    held = asyncio.ensure_future(_complete(client))
    await wait_until(lambda: gate.num_held == 1, 10, "the request to wait at the gate")
    assert not held.done() and engine.requests == []  # held before any engine saw it
    assert (await client.get("/load")).json() == {"server_load": 1}
    assert (await client.post("/resume")).json() == {"is_paused": False}
    assert (await asyncio.wait_for(held, 10)).status_code == 200
    assert engine.utility_calls == [UtilityMethod.PAUSE, UtilityMethod.RESUME]


async def test_pause_wait_returns_once_running_requests_finish(served):
    client, engine, gate = served
    engine.hang_after = 2
    running = asyncio.ensure_future(_complete(client, max_tokens=5))
    await asyncio.wait_for(engine.hanging.wait(), 10)
    pause = asyncio.ensure_future(client.post("/pause", params={"mode": "wait"}))
    await wait_until(lambda: gate.is_paused, 10, "the pause to begin")
    assert not pause.done() and UtilityMethod.PAUSE not in engine.utility_calls  # it waits
    running.cancel()  # the running request ends (its client left)
    await asyncio.gather(running, return_exceptions=True)
    response = await asyncio.wait_for(pause, 10)
    assert response.json() == {"is_paused": True, "mode": "wait", "cache_cleared": True}
    assert engine.utility_calls == [UtilityMethod.PAUSE, UtilityMethod.RESET_PREFIX_CACHE]


async def test_pause_abort_aborts_running_requests(served):
    client, engine, _gate = served
    engine.hang_after = 1
    running = asyncio.ensure_future(_complete(client))
    await asyncio.wait_for(engine.hanging.wait(), 10)
    [request] = engine.requests
    response = await client.post("/pause")  # vLLM's default mode: abort
    assert response.json()["mode"] == "abort"
    assert request.request_id in engine.aborted
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)


async def test_pause_takes_vllms_earlier_wait_flag(served):
    client, engine, _ = served
    params = {"wait_for_inflight_requests": "true", "clear_cache": "false"}
    response = await client.post("/pause", params=params)
    assert response.json() == {"is_paused": True, "mode": "wait", "cache_cleared": None}
    assert engine.utility_calls == [UtilityMethod.PAUSE]


async def test_pause_reports_a_cache_that_was_not_reset(served):
    client, engine, _gate = served
    engine.reset_refused = True
    response = await client.post("/pause", params={"mode": "keep"})
    assert response.json()["cache_cleared"] is False


@pytest.mark.parametrize(
    "query, param",
    [
        ({"mode": "sleep"}, "mode"),
        ({"clear_cache": "yes"}, "clear_cache"),
        ({"wait_for_inflight_requests": "maybe"}, "wait_for_inflight_requests"),
        ({"mode": "wait", "wait_for_inflight_requests": "true"}, "wait_for_inflight_requests"),
        ({"timeout": "5"}, "timeout"),
        ({"mode": ["wait", "keep"]}, "mode"),
    ],
)
async def test_pause_refuses_bad_query_parameters(served, query, param):
    client, engine, _gate = served
    response = await client.post("/pause", params=query)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert engine.utility_calls == [] and (await client.get("/is_paused")).json()["is_paused"] is False


async def test_reset_prefix_cache(served):
    client, engine, _gate = served
    response = await client.post("/reset_prefix_cache")
    assert response.status_code == 200 and response.json() == {"reset": True, "ranks": [0]}
    engine.reset_refused = True
    response = await client.post("/reset_prefix_cache")
    assert response.status_code == 409
    assert "in use" in response.json()["error"]["message"] and response.json()["error"]["code"] == 409


async def test_engine_trouble_is_a_5xx_not_a_client_error():
    engine = FakeEngineClient()

    async def no_rank(method):
        raise EngineNotReadyError("No engine core is ready.")

    engine.call_utility = no_rank
    client = http_client(make_app(engine, admin_api_key=ADMIN)[0], headers=ADMIN_AUTH)
    response = await client.post("/reset_prefix_cache")
    assert response.status_code == 503 and response.headers["retry-after"]


async def test_models_by_id_and_several_served_names():
    app, _ = make_app(served_model_name=["first", "second"])
    client = http_client(app)
    listed = (await client.get("/v1/models")).json()["data"]
    assert [card["id"] for card in listed] == ["first", "second"]
    assert (await client.get("/v1/models/second")).json()["id"] == "second"
    missing = await client.get("/v1/models/" + MODEL_NAME)
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": f"The model `{MODEL_NAME}` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    for name in ("first", "second"):
        response = await client.post("/v1/completions", json={"prompt": "x", "model": name, "max_tokens": 1})
        assert response.status_code == 200 and response.json()["model"] == "first"


async def test_management_posts_need_the_admin_key_and_reads_do_not():
    app, engine = make_app(api_key=KEY, admin_api_key=ADMIN)
    client = http_client(app)
    authorized = {"Authorization": f"Bearer {KEY}"}
    for path in ("/pause", "/resume", "/reset_prefix_cache"):
        assert (await client.post(path)).status_code == 401, path
        assert (await client.post(path, headers=authorized)).status_code == 401, path  # a tenant's key
    assert engine.utility_calls == []
    assert (await client.get("/load")).status_code == 200
    assert (await client.get("/is_paused")).status_code == 200
    assert (await client.post("/reset_prefix_cache", headers=ADMIN_AUTH)).status_code == 200
    assert (await client.get(f"/v1/models/{MODEL_NAME}")).status_code == 401
    assert (await client.get(f"/v1/models/{MODEL_NAME}", headers=authorized)).status_code == 200


async def test_without_an_admin_key_no_caller_may_pause_or_reset():
    """The attack: any tenant key, or with no key at all a cross-site POST, paused every
    tenant's generation. Without --admin-api-key the management POSTs are off (403)."""
    app, engine = make_app(api_key=KEY)
    client = http_client(app, headers={"Authorization": f"Bearer {KEY}"})
    for path in ("/pause?mode=abort", "/resume", "/reset_prefix_cache"):
        response = await client.post(path)
        assert response.status_code == 403 and "--admin-api-key" in response.json()["error"]["message"]
    open_app, open_engine = make_app()
    assert (await http_client(open_app).post("/pause?mode=abort")).status_code == 403
    assert engine.utility_calls == open_engine.utility_calls == []


async def test_a_cross_site_simple_post_is_refused():
    """A browser sends text/plain or form POSTs cross-site without a preflight: any POST with a
    body must be application/json (415), before the route reads it."""
    app, engine = make_app()
    client = http_client(app)
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = {} if content_type is None else {"content-type": content_type}
        response = await client.post("/v1/completions", content=body, headers=headers)
        assert response.status_code == 415, content_type
    assert engine.requests == []
    typed = {"content-type": "application/json; charset=utf-8"}
    assert (await client.post("/v1/completions", content=body, headers=typed)).status_code == 200


async def test_health_says_paused_and_held_requests_have_a_deadline():
    app, engine = make_app(admin_api_key=ADMIN, limits=ServingLimits(pause_hold_timeout_s=0.2))
    client = http_client(app, headers=ADMIN_AUTH)
    assert (await client.get("/health")).status_code == 200
    assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "paused"
    assert "paused" in health.json()["reason"]
    held = await _complete(client)  # waits its hold deadline, then is turned away
    assert held.status_code == 503 and "paused" in held.json()["error"]["message"]
    assert engine.requests == [] and app.state.engine_client.num_held == 0
    await client.post("/resume")
    assert (await client.get("/health")).status_code == 200
