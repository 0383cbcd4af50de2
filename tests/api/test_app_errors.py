"""Every way a request can be refused: its status and OpenAI's error shape."""

from __future__ import annotations

import json

import pytest

from services.api.engine_client import RankStats
from tests.api.fake_engine_client import MODEL_NAME, FakeEngineClient, engine_config, http_client, make_app

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "word " * 300  # more tokens than the test max_model_len of 256


@pytest.fixture
def served():
    app, engine = make_app()
    return http_client(app), engine


def assert_error(response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and error["type"].endswith("Error")
    if param != "any":
        assert error["param"] == param
    return error


BAD_COMPLETIONS = [
    ({"prompt": "Hi", "model": "gpt-4"}, "model"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [49152]}, "prompt"),
    ({"prompt": [-1]}, "prompt[0]"),
    ({"prompt": LONG_PROMPT}, "prompt"),
    ({"prompt": "Hi", "max_tokens": 256}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "top_k": -2}, "top_k"),
    ({"prompt": "Hi", "min_p": 2}, "min_p"),
    ({"prompt": "Hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": "Hi", "stop": 5}, "stop"),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "Hi", "seed": 2**70}, "seed"),
    ({"prompt": "Hi", "priority": 1}, "priority"),
    ({"prompt": "Hi", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "Hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({}, None),
    ({"prompt": None}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
async def test_bad_completion_bodies(served, body, param):
    client, engine = served
    assert_error(await client.post(COMPLETIONS, json=body), 400, param)
    assert engine.requests == []


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": [{"content": "Hi"}]}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ({"messages": MESSAGES, "max_tokens": 250}, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": 250}, "max_completion_tokens"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": MESSAGES, "model": "nope"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
async def test_bad_chat_bodies(served, body, param):
    client, engine = served
    error = assert_error(await client.post(CHAT, json=body), 400)
    if param is not None:
        assert error["param"] == param
    assert engine.requests == []


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize", "/detokenize"])
@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe garbage", b"[1, 2]", b"null", b'"str"'])
async def test_malformed_bodies(served, path, raw):
    client, _ = served
    assert_error(await client.post(path, content=raw, headers=JSON), 400)


async def test_out_of_range_float(served):
    client, _ = served
    response = await client.post(COMPLETIONS, content=b'{"prompt": "Hi", "temperature": 1e999}', headers=JSON)
    assert_error(response, 400, "temperature")


async def test_unknown_routes_and_methods(served):
    client, _ = served
    assert_error(await client.get("/v1/nothing"), 404, None)
    assert_error(await client.get(COMPLETIONS), 405, None)


async def test_api_key_guards_only_v1():
    app, _ = make_app(api_key="sekrit")
    client = http_client(app)
    body = {"prompt": "Hi", "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "sekrit"},
        {"Authorization": "Basic sekrit"},
    ):
        assert_error(await client.post(COMPLETIONS, json=body, headers=headers), 401)
    assert_error(await client.get("/v1/models"), 401)
    ok = await client.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    for path in ("/health", "/metrics", "/version"):
        assert (await client.get(path)).status_code == 200


async def test_priority_allowed_under_priority_scheduling():
    app, engine = make_app(config=engine_config(policy="priority"))
    response = await http_client(app).post(
        COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, "priority": -3}
    )
    assert response.status_code == 200 and engine.requests[0].priority == -3


async def test_no_ready_rank_is_503():
    engine = FakeEngineClient(num_ranks=2)
    engine.ranks = {0: RankStats(0, state="waiting"), 1: RankStats(1, state="dead")}
    app, _ = make_app(engine)
    client = http_client(app)
    assert_error(await client.post(COMPLETIONS, json={"prompt": "Hi"}), 503)
    assert_error(await client.post(CHAT, json={"messages": MESSAGES, "stream": True}), 503)
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["waiting"] == [0] and health.json()["dead"] == [1]


async def test_engine_death_non_streaming_is_500():
    engine = FakeEngineClient()
    engine.die_after = 2
    app, _ = make_app(engine)
    assert_error(await http_client(app).post(COMPLETIONS, json={"prompt": "Hi", "n": 2}), 500)


@pytest.mark.parametrize("path,body", [(COMPLETIONS, {"prompt": "Hi"}), (CHAT, {"messages": MESSAGES})])
async def test_engine_death_mid_stream_sends_error_event_then_done(path, body):
    engine = FakeEngineClient()
    engine.die_after = 2
    app, _ = make_app(engine)
    response = await http_client(app).post(path, json={**body, "stream": True, "max_tokens": 10})
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "died" in error["message"]
    assert any("choices" in json.loads(e) for e in events[:-2])


async def test_request_failed_in_engine_is_400():
    engine = FakeEngineClient()
    engine.fail_with = "grammar does not compile"
    app, _ = make_app(engine)
    client = http_client(app)
    error = assert_error(await client.post(COMPLETIONS, json={"prompt": "Hi"}), 400)
    assert error["message"] == "grammar does not compile"
    streamed = await client.post(COMPLETIONS, json={"prompt": "Hi", "stream": True})
    assert '"grammar does not compile"' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")


async def test_model_field_may_be_omitted_or_exact(served):
    client, _ = served
    for body in ({"prompt": "Hi", "max_tokens": 1}, {"prompt": "Hi", "max_tokens": 1, "model": MODEL_NAME}):
        assert (await client.post(COMPLETIONS, json=body)).status_code == 200
