"""Tool calling on /v1/chat/completions, against the fake engine, through the openai client."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from services.api import structured_outputs, tool_calling
from services.api.chat_args import ChatSettings
from services.api.errors import APIError
from services.api.openai_schemas import ChatTool, decode_body
from services.api.tool_calling import required_schema
from tests.api.fake_engine_client import MODEL_NAME
from tests.api.tool_scripts import END, TOOL_TEMPLATE, prompt_text, scripted

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
AUTO = ChatSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
HERMES_REPLY = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def create(client, **kwargs):
    kwargs = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 60, **kwargs}
    extra = {"stop_token_ids": END, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(extra_body=extra, **kwargs)


async def stream_of(client, **kwargs):
    """The streamed reply: (content, {index: [id, name, arguments]}, finish_reason)."""
    content, calls, finish = "", {}, None
    async for chunk in await create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name  # a call's first delta names it
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def assert_400(error: pytest.ExceptionInfo, param: str) -> None:
    assert error.value.status_code == 400 and error.value.body["param"] == param


@pytest.mark.parametrize("tool_choice", [openai.NOT_GIVEN, "auto"])
async def test_auto_needs_the_server_to_enable_it(tool_choice):
    client, engine = scripted("Hi")
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice") as error:
        await create(client, tools=TOOLS, tool_choice=tool_choice)
    assert_400(error, "tool_choice")
    assert engine.requests == []


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
            "tool_choice",
        ),
        ({"tools": [TOOLS[1], TOOLS[1]], "tool_choice": "required"}, "tools[1].function.name"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
async def test_tool_requests_that_cannot_be_served(kwargs, param):
    client, engine = scripted("Hi")
    with pytest.raises(openai.BadRequestError) as error:
        await create(client, **kwargs)
    assert_400(error, param)
    assert engine.requests == []


# Another field asking for structured output, each invalid: checked, it would be a 400 naming itself.
SECOND_CONSTRAINTS = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
    {"response_format": {"type": "json_object"}},
    {"extra_body": {"guided_regex": "(unclosed"}},
    {"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}},
]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
@pytest.mark.parametrize("asked", SECOND_CONSTRAINTS)
async def test_forced_calls_with_another_constraint_are_refused_before_either_is_built(
    monkeypatch, tool_choice, asked
):
    def never(*args, **kwargs):
        raise AssertionError("a constraint was built or checked before the conflict was found")

    for module, name in [
        (structured_outputs, "check_constraint"),
        (structured_outputs, "_from_response_format"),
        (tool_calling, "check_constraint"),
        (tool_calling, "required_schema"),
    ]:
        monkeypatch.setattr(module, name, never)
    client, engine = scripted("Hi")
    with pytest.raises(openai.BadRequestError, match="already constrains the output") as error:
        await create(client, tools=TOOLS, tool_choice=tool_choice, **asked)
    assert_400(error, "tool_choice")
    assert engine.requests == []


async def test_none_shows_the_tools_to_the_template_and_returns_text():
    client, engine = scripted(HERMES_REPLY, ChatSettings(chat_template=TOOL_TEMPLATE))
    reply = await create(client, tools=TOOLS, tool_choice="none")
    assert prompt_text(engine).startswith("TOOLS:" + json.dumps(TOOLS) + "\nuser: Weather in Paris?")
    assert engine.requests[0].sampling_params.structured_outputs is None
    [choice] = reply.choices
    assert choice.message.content == HERMES_REPLY and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


async def test_history_of_calls_and_results_reaches_the_template():
    client, engine = scripted("It is sunny.", ChatSettings(chat_template=TOOL_TEMPLATE))
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    reply = await create(client, messages=history, tools=TOOLS, tool_choice="none")
    assert prompt_text(engine) == (
        "TOOLS:" + json.dumps(TOOLS) + "\nuser: Weather in Paris?\n"
        'assistant: CALL call_1 get_weather {"city": "Paris"} city=Paris\n'
        'tool: {"sky": "sunny"} (answers call_1)\nassistant:'
    )
    assert reply.choices[0].message.content == "It is sunny."


@pytest.mark.parametrize(
    "message,param",
    [
        ({"role": "tool", "content": "42"}, "messages[1].tool_call_id"),
        (
            {
                "role": "user",
                "content": "hi",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
                ],
            },
            "messages[1].tool_calls",
        ),
    ],
)
async def test_malformed_tool_history(message, param):
    client, _ = scripted("Hi")
    with pytest.raises(openai.BadRequestError) as error:
        await create(client, messages=[*ASK, message])
    assert_400(error, param)


async def test_auto_finds_the_calls():
    client, engine = scripted(HERMES_REPLY, AUTO)
    reply = await create(client, tools=TOOLS)
    assert engine.requests[0].sampling_params.structured_outputs is None  # auto: the model decides
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


async def test_auto_streams_the_calls():
    client, _ = scripted(HERMES_REPLY + "\n" + HERMES_REPLY.replace("Paris", "Oslo"), AUTO)
    content, calls, finish = await stream_of(client, tools=TOOLS, tool_choice="auto", max_tokens=150)
    assert content == "Checking.\nChecking." and finish == "tool_calls"
    assert [(name, json.loads(arguments)) for _, name, arguments in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert len({call_id for call_id, _, _ in calls.values()}) == 2


MISTRAL = ChatSettings(enable_auto_tool_choice=True, tool_call_parser="mistral")
MISTRAL_REPLY = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'


@pytest.mark.parametrize("stream", [False, True])
async def test_mistral_calls_get_mistral_ids_and_keep_special_tokens(stream):
    client, engine = scripted(MISTRAL_REPLY, MISTRAL)
    if stream:
        content, calls, finish = await stream_of(client, tools=TOOLS)
        ids = [call_id for call_id, _, _ in calls.values()]
        found = [(name, json.loads(arguments)) for _, name, arguments in calls.values()]
    else:
        [choice] = (await create(client, tools=TOOLS)).choices
        content, finish = choice.message.content, choice.finish_reason
        ids = [call.id for call in choice.message.tool_calls]
        found = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert (content, finish) == ("Checking.", "tool_calls")
    assert found == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    # Mistral's templates take only 9 letters and digits as a call's id.
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids) and len(set(ids)) == 2
    # [TOOL_CALLS] is a special token in Mistral's vocabularies: the text must keep it.
    assert engine.requests[0].sampling_params.skip_special_tokens is False


async def test_special_tokens_are_skipped_as_asked_without_auto_tool_choice():
    client, engine = scripted("Hi", MISTRAL)
    await create(client, tools=TOOLS, tool_choice="none")
    await create(client)
    assert [r.sampling_params.skip_special_tokens for r in engine.requests] == [True, True]


async def test_pythonic_calls_over_the_app():
    reply = '[get_weather(city="Paris"), get_time()]'
    client, _ = scripted(reply, ChatSettings(enable_auto_tool_choice=True, tool_call_parser="pythonic"))
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    [choice] = (await create(client, tools=TOOLS)).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ] == expected
    content, calls, finish = await stream_of(client, tools=TOOLS)
    assert (content, finish) == ("", "tool_calls")
    assert [(name, json.loads(arguments)) for _, name, arguments in calls.values()] == expected


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_with_a_malformed_call_answers_plain_content(stream):
    text = 'Here: <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    client, _ = scripted(text, AUTO)
    if stream:
        assert await stream_of(client, tools=TOOLS) == (text, {}, "stop")
    else:
        [choice] = (await create(client, tools=TOOLS)).choices
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, [], "stop")


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("stream", [False, True])
async def test_named_function_is_forced_by_its_schema(stream):
    client, engine = scripted('{"city": "Paris"}')
    if stream:
        content, calls, finish = await stream_of(client, tools=TOOLS, tool_choice=NAMED)
        [(_, name, arguments)] = calls.values()
        assert content == ""
    else:
        [choice] = (await create(client, tools=TOOLS, tool_choice=NAMED)).choices
        [call] = choice.message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
        assert not choice.message.content
    assert (name, arguments, finish) == ("get_weather", '{"city": "Paris"}', "tool_calls")
    constraint = engine.requests[0].sampling_params.structured_outputs
    assert json.loads(constraint.json) == WEATHER_PARAMETERS


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("stream", [False, True])
async def test_required_is_forced_by_an_array_schema(stream, parallel):
    client, engine = scripted(
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    )
    kwargs = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel}
    if stream:
        content, calls, finish = await stream_of(client, **kwargs)
        got = [(name, json.loads(arguments)) for _, name, arguments in calls.values()]
    else:
        [choice] = (await create(client, **kwargs)).choices
        content, finish = choice.message.content, choice.finish_reason
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert got == (expected if parallel else expected[:1]) and finish == "tool_calls" and not content
    schema = json.loads(engine.requests[0].sampling_params.structured_outputs.json)
    assert schema == required_schema(tool_structs(TOOLS), parallel)
    assert schema.get("maxItems") == (None if parallel else 1)
    assert [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]


def tool_structs(tools: list[dict]) -> tuple[ChatTool, ...]:
    return tuple(decode_body(json.dumps(t).encode(), ChatTool) for t in tools)


async def test_required_cut_short_is_content_not_an_error():
    client, _ = scripted('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_ti')
    [choice] = (await create(client, tools=TOOLS, tool_choice="required", max_tokens=20)).choices
    assert choice.finish_reason == "length"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert choice.message.content and '{"name": "get_ti'.startswith(choice.message.content)


def test_required_schema_hoists_defs_for_references():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    tool = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/point"}},
                "$defs": {"point": point},
            },
        },
    }
    schema = required_schema(tool_structs([tool]))
    assert schema["$defs"] == {"point": point}
    [option] = schema["items"]["anyOf"]
    assert option["properties"]["parameters"] == {
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/point"}},
    }
    assert option["properties"]["name"] == {"type": "string", "enum": ["move"]}


def test_tools_defining_one_name_differently_are_refused():
    def tool(name, x_type):
        return {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "$defs": {"p": {"type": x_type}},
                    "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/p"}},
                },
            },
        }

    with pytest.raises(APIError) as error:
        required_schema(tool_structs([tool("f", "number"), tool("g", "string")]))
    assert error.value.status == 400 and error.value.param == "tools[1].function.parameters"


async def test_streamed_calls_add_up_in_the_openai_sdks_own_accumulator():
    # The SDK's ChatCompletionStreamState is what client.chat.completions.stream() uses:
    # it must rebuild the same message, per choice, from our deltas.
    client, _ = scripted(HERMES_REPLY, AUTO)
    state = ChatCompletionStreamState()
    async for chunk in await create(client, tools=TOOLS, n=2, stream=True):
        state.handle_chunk(chunk)
    completion = state.get_final_completion()
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        [call] = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert completion.choices[0].message.tool_calls[0].id != completion.choices[1].message.tool_calls[0].id
