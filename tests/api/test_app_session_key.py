"""The sticky-session key reaches the balancer: ``x-session-id`` first, then ``user``."""

from __future__ import annotations

import pytest

from services.api.prefix_router import MAX_SESSION_KEY_CHARS
from tests.api.fake_engine_client import http_client, make_app


@pytest.fixture
def served():
    app, engine = make_app()
    return http_client(app), engine


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ],
)
async def test_header_wins_over_user_and_user_is_the_fallback(served, route, body):
    client, engine = served
    assert (
        await client.post(route, json=body | {"user": "u1"}, headers={"x-session-id": "s1"})
    ).status_code == 200
    assert (await client.post(route, json=body | {"user": "u1"})).status_code == 200
    assert (await client.post(route, json=body)).status_code == 200
    assert [r.session_key for r in engine.requests] == ["s1", "u1", None]


async def test_a_huge_session_key_is_refused_naming_its_source(served):
    client, engine = served
    huge = "k" * (MAX_SESSION_KEY_CHARS + 1)
    body = {"prompt": "hi", "max_tokens": 1}
    by_header = await client.post("/v1/completions", json=body, headers={"x-session-id": huge})
    by_user = await client.post("/v1/completions", json=body | {"user": huge})
    assert by_header.status_code == by_user.status_code == 400
    assert by_header.json()["error"]["param"] == "x-session-id"
    assert by_user.json()["error"]["param"] == "user"
    assert engine.requests == []
