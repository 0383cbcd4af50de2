"""A client that leaves aborts its engine requests, streaming or not.

httpx's ASGITransport buffers whole responses and never disconnects, so
these tests drive the ASGI app by hand: the receive channel hands over the
body, then reports ``http.disconnect`` once the test says so.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.api.fake_engine_client import FakeEngineClient, make_app

MESSAGES = [{"role": "user", "content": "Hi"}]


async def call(app, path: str, body: dict, disconnect: asyncio.Event, sent: list[dict]) -> None:
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "server": ("test", 80),
        "client": ("127.0.0.1", 5000),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=30)


def hanging_app():
    engine = FakeEngineClient()
    engine.hang_after = 3  # three tokens, then nothing until cancelled
    app, _ = make_app(engine)
    return app, engine


@pytest.mark.parametrize(
    "path,body", [("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MESSAGES})]
)
async def test_disconnect_mid_stream_aborts(path, body):
    app, engine = hanging_app()
    disconnect, sent = asyncio.Event(), []

    async def leave_after_first_token() -> None:
        await engine.hanging.wait()
        disconnect.set()

    await asyncio.gather(
        call(app, path, {**body, "stream": True, "n": 2, "max_tokens": 50}, disconnect, sent),
        leave_after_first_token(),
    )
    ids = {r.request_id for r in engine.requests}
    assert len(ids) == 2
    assert engine.aborted == ids and engine.closed_early == ids
    streamed = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert streamed.startswith(b"data: ") and b"[DONE]" not in streamed


@pytest.mark.parametrize(
    "path,body", [("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MESSAGES})]
)
async def test_disconnect_while_waiting_for_json_aborts(path, body):
    app, engine = hanging_app()
    sent: list[dict] = []
    await call(app, path, {**body, "max_tokens": 50}, engine.hanging, sent)
    [request] = engine.requests
    assert engine.aborted == {request.request_id} and engine.closed_early == {request.request_id}
    assert sent[0]["status"] == 499


async def test_finished_requests_are_not_aborted():
    app, engine = make_app()
    sent: list[dict] = []
    await call(
        app, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True}, asyncio.Event(), sent
    )
    assert sent[0]["status"] == 200 and engine.aborted == set() and engine.closed_early == set()
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
