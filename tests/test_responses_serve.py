"""The Responses API end to end: ``weft serve`` on the real default model, with two API keys,
through the official openai SDK (its own request building, event parsing and stream helpers)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from benchmarks.stack import Stack
from services import model_files

pytestmark = pytest.mark.slow

MODEL = model_files.resolve(None)
KEYS = ("tenant-a-key", "tenant-b-key")
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 24}},
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER,
    }
]
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ``weft serve``: the default model, two API keys, a small responses store."""
    args = ["--model", str(MODEL.weights), "--dtype", "float32", "--max-model-len", "1024"]
    args += ["--max-num-batched-tokens", "512", "--num-threads", "1", "--responses-store-max-entries", "64"]
    for key in KEYS:
        args += ["--api-key", key]
    stack = Stack(args, tmp_path_factory.mktemp("responses-server"), startup_timeout_s=240)
    try:
        stack.wait_healthy()
        yield stack.url
    finally:
        stack.kill()


def client_for(url: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def client(server):
    return client_for(server)


def create(client, **kwargs):
    return client.responses.create(
        **{"model": MODEL.name, "max_output_tokens": 24, "temperature": 0, **kwargs}
    )


def test_a_plain_response(client):
    response = create(client, input="Name a colour.", instructions="Answer in one word.")
    assert response.status in ("completed", "incomplete") and response.output_text.strip()
    [message] = response.output
    assert message.type == "message" and message.content[0].type == "output_text"
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_a_forced_function_call_and_its_answer_through_previous_response_id(client):
    first = create(client, input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"sky": "sunny", "degrees": 21}',
    }
    second = create(client, previous_response_id=first.id, input=[answer], tools=TOOLS, tool_choice="none")
    assert second.previous_response_id == first.id and second.output_text.strip()
    # The stored conversation went first: the second prompt is longer than the whole first exchange.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_json_schema_output_parses_and_matches(client):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["colour"],
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    }
    text = {"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}}
    response = create(client, input="Pick a colour.", text=text, max_output_tokens=40)
    jsonschema.validate(json.loads(response.output_text), schema)


def test_a_stream_through_the_sdks_helpers(client):
    kwargs = {"model": MODEL.name, "input": "Tell me about Paris.", "max_output_tokens": 16, "temperature": 0}
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = create(client, **{k: v for k, v in kwargs.items() if k != "model"})
    assert text == whole.output_text  # greedy: the stream and the whole reply are the same text
    if final is not None:
        assert final.output_text == text
    raw = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    # Deltas may carry several tokens each (as the engine's outputs arrive): the rest is the same.
    assert [e.type for e in raw if not e.type.endswith(".delta")] == [
        t for t in types if not t.endswith(".delta")
    ]
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == text


def test_another_key_cannot_read_a_stored_response(server, client):
    response = create(client, input="Hi")
    other = client_for(server, KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        create(other, input="Go on.", previous_response_id=response.id)
    assert client.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.AuthenticationError):
        client_for(server, "no-such-key").responses.retrieve(response.id)


def test_what_cannot_be_served_is_a_400_naming_the_field(client):
    for kwargs, param in [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            create(client, input="Hi", **kwargs)
        assert error.value.body["param"] == param
