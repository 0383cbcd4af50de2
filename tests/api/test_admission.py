"""Admission control, limits, timeouts and the drain, on the app with a fake engine.

The fake engine can hang a request after a few tokens, which is how these
tests hold slots: a hanging request stays admitted until its client goes,
it times out, or the drain stops it.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest

from protocol import SchedulerConfig
from services.api.limits import ServingLimits
from tests.api.fake_engine_client import FakeEngineClient, engine_config, http_client, make_app
from tests.api.test_app_disconnect import call
from tests.polling import wait_until

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_NUM_SEQS, MAX_WAITING = 2, 1  # one rank holds 3 sequences


def app_with(limits: ServingLimits | None = None, hang_after: int | None = None, **kwargs):
    engine = FakeEngineClient()
    engine.hang_after = hang_after
    config = msgspec.structs.replace(engine_config(), scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS))
    limits = limits or ServingLimits(max_waiting_requests=MAX_WAITING)
    app, _ = make_app(engine, config=config, limits=limits, **kwargs)
    return app, engine


def assert_error(response: httpx.Response, status: int, param: str | None = "unset") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and "Traceback" not in response.text
    if param != "unset":
        assert error["param"] == param
    return error


async def test_excess_requests_get_503_with_retry_after_until_slots_free_up():
    app, engine = app_with(hang_after=1)
    client = http_client(app)
    admission = app.state.admission
    hanging = [
        asyncio.create_task(client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 9}))
        for _ in range(MAX_NUM_SEQS + MAX_WAITING)
    ]
    await wait_until(
        lambda: admission.in_use == 3 and len(engine.requests) == 3, 10, "3 admitted", interval_s=0.01
    )
    response = await client.post(
        CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    assert "overloaded" in assert_error(response, 503)["message"]
    assert response.headers["Retry-After"] == "1"
    streamed = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert_error(streamed, 503)  # refused before the stream starts: a plain JSON error
    assert len(engine.requests) == 3  # the refused ones never reached the engine
    metrics = (await client.get("/metrics")).text
    assert (
        'weft:requests_rejected_total{model_name="SmolLM2-135M-Instruct",reason="overloaded"} 2.0' in metrics
    )
    health = (await client.get("/health")).json()
    assert health["admitted"] == 3 and health["capacity"] == 3
    for task in hanging:  # their clients leave
        task.cancel()
    await asyncio.gather(*hanging, return_exceptions=True)
    assert admission.in_use == 0 and engine.closed_early == {r.request_id for r in engine.requests}
    engine.hang_after = None
    assert (await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})).status_code == 200
    assert admission.in_use == 0


async def test_more_sequences_than_one_rank_takes_is_a_400():
    app, engine = app_with()
    client = http_client(app)
    assert_error(await client.post(COMPLETIONS, json={"prompt": "Hi", "n": 4}), 400, "n")
    assert_error(await client.post(COMPLETIONS, json={"prompt": ["a", "b"], "n": 2}), 400, "prompt")
    assert_error(
        await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "n": 4}), 400, "n"
    )
    assert engine.requests == []


async def test_limits_on_n_max_tokens_and_prompt_length():
    limits = ServingLimits(max_n=2, max_tokens=5, max_prompt_tokens=40)
    app, engine = app_with(limits)
    client = http_client(app)
    assert_error(await client.post(COMPLETIONS, json={"prompt": "Hi", "n": 3}), 400, "n")
    assert_error(await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 6}), 400, "max_tokens")
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 6}
    assert_error(await client.post(CHAT, json=chat), 400, "max_completion_tokens")
    assert_error(await client.post(COMPLETIONS, json={"prompt": list(range(41))}), 400, "prompt")
    assert engine.requests == []
    ok = await client.post(COMPLETIONS, json={"prompt": list(range(40)), "max_tokens": None})
    assert (
        ok.status_code == 200 and engine.requests[0].sampling_params.max_tokens == 5
    )  # capped, not the context


async def test_bodies_over_the_limit_get_413():
    app, engine = app_with(ServingLimits(max_body_bytes=100))
    client = http_client(app, headers={"content-type": "application/json"})
    big = json.dumps({"prompt": "x" * 200}).encode()
    assert_error(await client.post(COMPLETIONS, content=big), 413)

    async def chunked():  # no Content-Length: the limit applies as the bytes arrive
        for i in range(0, len(big), 32):
            yield big[i : i + 32]

    assert_error(await client.post(COMPLETIONS, content=chunked()), 413)
    assert engine.requests == []
    assert (await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1})).status_code == 200


async def test_several_api_keys():
    app, _ = app_with(api_key=["first-key", "second-key"])
    client = http_client(app)
    body = {"prompt": "Hi", "max_tokens": 1}
    for key in ("first-key", "second-key"):
        response = await client.post(COMPLETIONS, json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
    for header in ("Bearer first-key2", "Bearer ", "Bearer second"):
        assert_error(await client.post(COMPLETIONS, json=body, headers={"Authorization": header}), 401)


async def test_request_timeout_aborts_the_request():
    app, engine = app_with(ServingLimits(request_timeout_s=0.3), hang_after=2)
    client = http_client(app)
    assert (
        "timed out"
        in assert_error(await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 9}), 504)[
            "message"
        ]
    )
    streamed = await client.post(
        CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9, "stream": True}
    )
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504
    assert engine.closed_early == {r.request_id for r in engine.requests} and len(engine.requests) == 2
    assert app.state.admission.in_use == 0


async def test_drain_refuses_new_requests_and_stops_the_stragglers():
    app, engine = app_with(hang_after=3)
    client = http_client(app)
    admission = app.state.admission
    assert await admission.drain(1.0) == 0  # nothing in flight: done at once
    admission.draining = False
    stream = asyncio.create_task(
        client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 9, "stream": True})
    )
    await engine.hanging.wait()
    drain = asyncio.create_task(admission.drain(0.3))
    await wait_until(lambda: admission.draining, 10, "draining", interval_s=0.01)
    refused = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1})
    assert "shutting down" in assert_error(refused, 503)["message"]
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert await drain == 1
    events = [line[6:] for line in (await stream).text.splitlines() if line.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and error["code"] == 503 and "shutting down" in error["message"]
    assert len(events) == 3 + 2  # the tokens it had, then the error and [DONE]
    assert engine.closed_early == {engine.requests[0].request_id} and admission.in_use == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_before_the_response_starts_returns_its_slot(stream):
    app, engine = app_with(hang_after=1)
    gone = asyncio.Event()
    gone.set()  # the disconnect is the first thing the app hears after the body
    sent: list[dict] = []
    await call(app, COMPLETIONS, {"prompt": "Hi", "max_tokens": 9, "stream": stream}, gone, sent)
    assert app.state.admission.in_use == 0


class _BrokenEngine(FakeEngineClient):
    async def generate(self, request):
        raise RuntimeError("internal detail: /srv/weft/secret.py line 12")
        yield  # an async generator


@pytest.mark.parametrize("stream", [True, False])
async def test_unexpected_errors_show_no_internals(stream):
    app, _ = make_app(_BrokenEngine())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "stream": stream})
    assert "internal detail" not in response.text and "Traceback" not in response.text
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"] == {
            "message": "Internal server error.",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    else:
        assert_error(response, 500)
