"""/v1/responses against the fake engine, through the openai client: output items, streamed
events, tools, reasoning, the store and its tenants, and the 400s."""

from __future__ import annotations

import json

import openai
import pytest

from services.api.chat_args import ChatSettings
from services.api.responses_store import ResponsesStore
from tests.api.fake_engine_client import (
    MODEL_NAME,
    FakeEngineClient,
    engine_config,
    make_app,
    openai_client,
    tokenizer,
)
from tests.api.tool_scripts import END, TOOL_TEMPLATE, prompt_text

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
WEATHER_CHOICE = {"type": "function", "name": "get_weather"}
R1 = ChatSettings(reasoning_parser="deepseek_r1")


def serve(text: str, chat: ChatSettings | None = None, client_key: str = "unused", **app_kwargs):
    """An openai client whose model writes ``text`` then its EOS, and the fake engine."""
    engine = FakeEngineClient()
    engine.script = tokenizer().encode(text, add_special_tokens=False) + END
    engine.stops_at_eos = True
    app, _ = make_app(engine, chat=chat, config=engine_config(1024), **app_kwargs)
    return openai_client(app, api_key=client_key), engine


def create(client, **kwargs):
    return client.responses.create(**{"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 60, **kwargs})


async def assert_error(call, status: int, param: str) -> None:
    with pytest.raises(openai.APIStatusError) as error:
        await call
    assert error.value.status_code == status and error.value.body["param"] == param, error.value.body


async def test_a_plain_reply_is_one_message_item():
    client, engine = serve("Hello there.")
    response = await create(client, instructions="Be brief.", metadata={"k": "v"}, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.output_text == "Hello there." and item.content[0].type == "output_text"
    assert response.metadata == {"k": "v"} and response.instructions == "Be brief."
    usage = response.usage
    assert usage.input_tokens == len(engine.requests[0].prompt_token_ids)
    assert usage.output_tokens == len(tokenizer().encode("Hello there.", add_special_tokens=False)) + 1
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    # The instructions lead as a system message, through the model's own chat template.
    expected = tokenizer().apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert prompt_text(engine) == expected


async def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    client, _ = serve("one two three four five six seven")
    response = await create(client, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    async with client.responses.stream(model=MODEL_NAME, input="Hi", max_output_tokens=3) as stream:
        types = [event.type async for event in stream]
    assert types[-1] == "response.incomplete"


async def test_the_stream_is_the_sdks_typed_events_and_its_final_response():
    client, _ = serve("Hello there, friend.")
    async with client.responses.stream(model=MODEL_NAME, input="Hi", max_output_tokens=60) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 2 and "".join(deltas) == "Hello there, friend."
    assert final.output_text == "Hello there, friend." and final.status == "completed"
    assert final.usage.output_tokens > 0
    # create(stream=True) parses the same events.
    raw = [e.type async for e in await create(client, stream=True)]
    assert raw == types


async def test_a_named_function_is_a_function_call_item():
    client, engine = serve('{"city": "Paris"}')
    for stream in (False, True):
        if stream:
            async with client.responses.stream(
                model=MODEL_NAME, input="Weather?", tools=TOOLS, tool_choice=WEATHER_CHOICE
            ) as events:
                argument_deltas = [
                    e.delta async for e in events if e.type == "response.function_call_arguments.delta"
                ]
                response = await events.get_final_response()
            assert len(argument_deltas) > 1  # the arguments stream as they are written
        else:
            response = await create(client, input="Weather?", tools=TOOLS, tool_choice=WEATHER_CHOICE)
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id and call.id.startswith("fc_")
    # The tools reached the engine as the chat path forces them: a JSON schema of the arguments.
    assert json.loads(engine.requests[0].sampling_params.structured_outputs.json) == WEATHER


async def test_auto_calls_follow_the_message_and_the_loop_continues_by_previous_response_id():
    hermes = ChatSettings(
        enable_auto_tool_choice=True, tool_call_parser="hermes", chat_template=TOOL_TEMPLATE
    )
    reply = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    client, engine = serve(reply, hermes)
    first = await create(client, input="Weather in Paris?", tools=TOOLS)
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Checking."
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    second = await create(
        client, previous_response_id=first.id, input=[output], tools=TOOLS, tool_choice="none"
    )
    assert second.previous_response_id == first.id
    prompt = prompt_text(engine, 1)
    # The stored turn (input, then output) leads; the call is the assistant's, its output a tool message.
    assert prompt.startswith("TOOLS:") and "user: Weather in Paris?\n" in prompt
    assert f"assistant: Checking.CALL {call.call_id} get_weather" in prompt
    assert f'tool: {{"sky": "clear"}} (answers {call.call_id})\nassistant:' in prompt


async def test_items_sent_back_by_the_client_become_the_same_conversation():
    client, engine = serve("Fine.", ChatSettings(chat_template=TOOL_TEMPLATE))
    items = [
        {"role": "developer", "content": "Be kind."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
    ]
    await create(client, input=items, tools=TOOLS, tool_choice="none")
    assert prompt_text(engine) == (
        f"TOOLS:{json.dumps([_chat_tool(t) for t in TOOLS])}\n"
        "system: Be kind.\nuser: Hi there\n"
        "assistant: Hello.CALL c1 get_time {} city=\n"
        "tool: noon (answers c1)\nassistant:"
    )


def _chat_tool(tool: dict) -> dict:
    function = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": function}


async def test_json_schema_format_is_the_chat_paths_constraint():
    client, engine = serve('{"answer": 4}')
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    text = {"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}}
    response = await create(client, text=text)
    assert json.loads(response.output_text) == {"answer": 4}
    assert json.loads(engine.requests[0].sampling_params.structured_outputs.json) == schema
    assert response.text.format.type == "json_schema"


async def test_with_a_reasoning_parser_the_thinking_is_a_reasoning_item():
    client, _ = serve("Two and two.</think>It is 4.", R1)
    response = await create(client, reasoning={"effort": "low"})
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Two and two."
    assert message.content[0].text == "It is 4."
    assert response.usage.output_tokens_details.reasoning_tokens == len(
        tokenizer().encode("Two and two.", add_special_tokens=False)
    )
    async with client.responses.stream(model=MODEL_NAME, input="Hi", max_output_tokens=60) as stream:
        events = [e async for e in stream]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == ("Two and two.", "It is 4.")
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"]


async def test_stored_responses_are_read_back_by_their_own_key_only():
    engine = FakeEngineClient()
    engine.stops_at_eos = True
    app, _ = make_app(engine, config=engine_config(1024), api_key=["key-a", "key-b"])
    tenant_a, tenant_b = openai_client(app, api_key="key-a"), openai_client(app, api_key="key-b")
    response = await create(tenant_a, max_output_tokens=4)
    assert (await tenant_a.responses.retrieve(response.id)).output_text == response.output_text
    await assert_error(tenant_b.responses.retrieve(response.id), 404, "response_id")
    await assert_error(tenant_b.responses.delete(response.id), 404, "response_id")
    await assert_error(create(tenant_b, previous_response_id=response.id), 404, "previous_response_id")
    with pytest.raises(openai.BadRequestError):
        await tenant_a.responses.retrieve(response.id, stream=True)
    await tenant_a.responses.delete(response.id)
    await assert_error(tenant_a.responses.retrieve(response.id), 404, "response_id")


async def test_store_false_keeps_nothing_and_a_disabled_store_refuses_store_true():
    client, _ = serve("Hello.")
    response = await create(client, store=False)
    assert response.to_dict()["store"] is False
    await assert_error(client.responses.retrieve(response.id), 404, "response_id")
    off, engine = serve("Hello.", responses_store=ResponsesStore(max_entries=0))
    await assert_error(create(off, store=True), 400, "store")
    await assert_error(create(off, previous_response_id="resp_x"), 400, "previous_response_id")
    assert (await create(off)).output_text == "Hello."  # store unset: not kept, said so
    assert engine.requests and len(engine.requests) == 1


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_stock"}}, "tool_choice"),
        ({"tools": TOOLS}, "tool_choice"),  # auto without --enable-auto-tool-choice
        (  # forced calls and a second constraint: the conflict, not the schema's error
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}},
            },
            "tool_choice",
        ),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text"),
    ],
)
async def test_what_cannot_be_served_is_an_error_naming_the_field(kwargs, param):
    client, engine = serve("Hi")
    status = 404 if kwargs.get("previous_response_id") else 400
    await assert_error(create(client, **kwargs), status, param)
    assert engine.requests == []


async def test_input_items_and_tools_are_bounded():
    from services.api.limits import ServingLimits

    client, _ = serve("Hi", limits=ServingLimits(max_messages=2, max_tools=1))
    await assert_error(create(client, input=[{"role": "user", "content": "a"}] * 3), 400, "input")
    await assert_error(create(client, tools=TOOLS, tool_choice="required"), 400, "tools")
