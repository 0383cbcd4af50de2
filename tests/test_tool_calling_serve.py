"""Tool calling end to end: ``weft serve`` on the real default model, through the openai client.

``required`` and a named function are forced by a JSON schema, so whatever
the model writes, each call must validate against its tool's parameters
(checked here with ``jsonschema``). The default model's template does not
render tools, so for ``auto`` it answers in words: that output must come
back as the same content streamed or whole.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from services.model_files import resolve

pytestmark = pytest.mark.slow

MODEL = resolve(None)
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
}
TIME = {
    "type": "object",
    "additionalProperties": False,
    "required": ["timezone"],
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a timezone.", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(default_server) -> str:
    """The session's ``weft serve``: one local engine core, auto tool choice on (hermes)."""
    return default_server.url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, stream: bool, messages=ASK, **kwargs):
    """The reply as (content, [(id, name, arguments)], finish_reason), streamed or whole."""
    kwargs = {
        "model": MODEL.name,
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": 80,
        "temperature": 0,
        **kwargs,
    }
    if stream:
        return streamed(client, **kwargs)[:3]
    [choice] = client.chat.completions.create(**kwargs).choices
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def streamed(client, **kwargs):
    """``ask``'s streamed reply, and how many argument fragments each call came in."""
    content, calls, fragments, finish = "", {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        [choice] = chunk.choices
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name  # a call's first delta names it
                calls[d.index], fragments[d.index] = [d.id, d.function.name, ""], 0
            calls[d.index][2] += d.function.arguments or ""
            fragments[d.index] += bool(d.function.arguments)
        finish = choice.finish_reason or finish
    return content or None, [tuple(c) for c in calls.values()], finish, list(fragments.values())


def assert_valid_calls(calls) -> None:
    assert calls
    for call_id, name, arguments in calls:
        assert call_id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_weather_conversation(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = ask(client, stream, tool_choice=named)
    assert finish == "tool_calls" and not content
    assert_valid_calls(calls)
    [(call_id, name, arguments)] = calls
    assert name == "get_weather"
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"sky": "sunny", "degrees": 21})},
    ]
    content, calls, finish = ask(client, stream, messages=history, tool_choice="none", max_tokens=24)
    assert content and calls == [] and finish in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_follow_their_tools_schemas(client, stream, parallel):
    messages = [{"role": "user", "content": "What time is it in Berlin, and how warm is it there?"}]
    content, calls, finish = ask(
        client,
        stream,
        messages=messages,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=120,
    )
    assert finish == "tool_calls" and not content
    assert_valid_calls(calls)
    if not parallel:
        assert len(calls) == 1


def test_forced_calls_stream_their_arguments_as_they_are_written(client):
    kwargs = {"model": MODEL.name, "messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        _, calls, finish, fragments = streamed(client, tool_choice=tool_choice, **kwargs)
        assert finish == "tool_calls" and calls
        # Every call's arguments came in several pieces (one per token or so), not at the end in one.
        assert all(n > 2 for n in fragments), fragments


def test_auto_reply_is_the_same_streamed_or_whole(client):
    whole = ask(client, stream=False, tool_choice="auto", max_tokens=24)
    streamed = ask(client, stream=True, tool_choice="auto", max_tokens=24)
    # Greedy decoding: one text, so one parse (call ids aside).
    assert _without_ids(whole) == _without_ids(streamed)
    assert whole[0] or whole[1]


def _without_ids(reply):
    content, calls, finish = reply
    return content, [call[1:] for call in calls], finish
