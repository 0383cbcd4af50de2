"""Structured outputs through the API, with the official openai client.

First against the fake engine (what reaches the engine, and the 400s that
stop a request before it does), then against a real ``weft serve`` with
the default model (outputs that validate, and the metrics).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from protocol import StructuredOutputsParams
from services.model_files import resolve
from tests.api.fake_engine_client import MODEL_NAME, make_app, openai_client

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
    },
    "required": ["city", "country", "population_millions"],
}


# ---------------------------------------------------------------- fake engine


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"guided_regex": r"\d+"}, StructuredOutputsParams(regex=r"\d+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutputsParams(grammar='root ::= "a" | "b"')),
        ({}, None),
    ],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_every_way_of_asking_reaches_the_engine(route, extra, expected):
    app, engine = make_app()
    client = openai_client(app)
    await _create(client, route, extra)
    [request] = engine.requests
    assert request.sampling_params.structured_outputs == expected


async def _create(client: openai.AsyncOpenAI, route: str, extra: dict, **kwargs):
    if route == "chat":
        return await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            extra_body=extra,
            **kwargs,
        )
    return await client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=3, extra_body=extra, **kwargs
    )


@pytest.mark.parametrize(
    "extra, param, message",
    [
        (
            {"structured_outputs": {"regex": "[a-z"}},
            "structured_outputs",
            "the regex is not valid: unclosed '['",
        ),
        ({"guided_regex": r"(?=a)b"}, "guided_regex", "lookahead"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "text"}}}},
            "guided_json",
            "$.properties.a.type: 'text' is not a JSON type",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {"guided_grammar": "root ::= num\nnum ::= [0-9]+ tail"},
            "guided_grammar",
            "rule 'tail' is used but never defined",
        ),
        ({"guided_grammar": "expr: NUM"}, "guided_grammar", "no 'start' rule"),
        ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "through one field only; this request sets response_format, guided_regex",
        ),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs", "exactly one of"),
    ],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_bad_constraints_are_400s_before_anything_is_scheduled(route, extra, param, message):
    app, engine = make_app()
    client = openai_client(app)
    with pytest.raises(openai.BadRequestError) as info:
        await _create(client, route, extra)
    assert info.value.status_code == 400 and message in info.value.message
    assert info.value.body["param"] == param
    assert engine.requests == []


async def test_a_compile_failure_in_the_engine_is_a_400_with_its_message():
    app, engine = make_app()
    engine.fail_with = "Invalid regex: Regex parsing error at position 3: Lookbehind is not supported yet."
    with pytest.raises(openai.BadRequestError, match="Lookbehind is not supported"):
        await _create(openai_client(app), "completions", {"guided_regex": "ab"})


# ---------------------------------------------------------------- real stack


@pytest.fixture(scope="module")
def server(default_server) -> str:
    """The session's ``weft serve`` (one local engine core on the default model)."""
    return default_server.url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_with_a_json_schema_response_format(client):
    response = client.chat.completions.create(
        model=resolve(None).name,
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        max_tokens=120,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_with_structured_outputs_choice(client):
    response = client.completions.create(
        model=resolve(None).name,
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=7,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert [c.text in ("yes", "no") for c in response.choices] == [True] * 3
    assert {c.finish_reason for c in response.choices} == {"stop"}


def test_streamed_completion_with_guided_regex(client):
    stream = client.completions.create(
        model=resolve(None).name,
        prompt="Today's date is",
        max_tokens=16,
        stream=True,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", text), text


def test_an_invalid_regex_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=resolve(None).name,
            prompt="x",
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )
    assert info.value.status_code == 400 and "unclosed '('" in info.value.message


def test_metrics_count_constrained_requests_and_compile_times(server, client):
    client.completions.create(
        model=resolve(None).name, prompt="Pick:", max_tokens=4, extra_body={"guided_choice": ["x", "y"]}
    )
    text = httpx.get(server + "/metrics", timeout=10).text
    [requests] = re.findall(r"^weft:structured_output_requests_total\{[^}]*\} (\S+)$", text, re.M)
    [compiles] = re.findall(r"^weft:structured_output_compile_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert float(requests) >= 1 and float(compiles) >= 1
