"""--reasoning-parser on /v1/chat/completions, and the thinking options reaching the chat template."""

from __future__ import annotations

import pytest

from services.api.chat_args import ChatSettings
from tests.api.fake_engine_client import MODEL_NAME
from tests.api.tool_scripts import END, prompt_text, scripted

ASK = [{"role": "user", "content": "2+2?"}]
QWEN3 = ChatSettings(reasoning_parser="qwen3")


def create(client, messages=ASK, **kwargs):
    extra = {"stop_token_ids": END, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=60, extra_body=extra, **kwargs
    )


async def streamed(client, **kwargs) -> tuple[str, str, list]:
    reasoning, content, chunks = "", "", []
    async for chunk in await create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content")  # both names, same text
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            chunks.append(delta)
    return reasoning, content, chunks


async def test_the_thinking_is_reasoning_content_whole_and_streamed():
    client, _ = scripted("<think>Two and two.</think>\n\nIt is 4.", QWEN3)
    [choice] = (await create(client)).choices
    message = choice.message.model_dump()
    assert message["reasoning_content"] == message["reasoning"] == "Two and two."
    assert message["content"] == "\n\nIt is 4."
    reasoning, content, chunks = await streamed(client)
    assert (reasoning, content) == ("Two and two.", "\n\nIt is 4.")
    # The tags never show, not even in pieces.
    assert not any("<" in (c.get("content") or "") + (c.get("reasoning_content") or "") for c in chunks)


async def test_without_tags_qwen3_is_all_content_and_without_a_parser_nothing_changes():
    client, _ = scripted("It is 4.", QWEN3)
    message = (await create(client)).choices[0].message.model_dump()
    assert message["content"] == "It is 4." and message["reasoning_content"] is None
    plain, _ = scripted("<think>x</think>y")
    message = (await create(plain)).choices[0].message.model_dump()
    assert message["content"] == "<think>x</think>y" and "reasoning_content" not in message


async def test_calls_are_parsed_from_the_text_after_the_thinking():
    settings = ChatSettings(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1"
    )
    reply = 'Call it.</think><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    client, _ = scripted(reply, settings)
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    [choice] = (await create(client, tools=tools)).choices
    assert choice.message.model_dump()["reasoning_content"] == "Call it."
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_time"
    reasoning, content, chunks = await streamed(client, tools=tools)
    assert reasoning == "Call it." and not content.strip()
    assert any(c.get("tool_calls") for c in chunks)


async def test_a_constrained_reply_is_not_split():
    # The constraint binds from the first token: there is no thinking to take apart.
    client, _ = scripted('{"a": 1}', ChatSettings(reasoning_parser="deepseek_r1"))
    message = (await create(client, response_format={"type": "json_object"})).choices[0].message.model_dump()
    assert message["content"] == '{"a": 1}' and message.get("reasoning_content") is None


EFFORT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.reasoning_content %} [thought: {{ m.reasoning_content }}]{% endif %}\n{% endfor %}"
    "effort={{ reasoning_effort | default('unset') }} thinking={{ enable_thinking | default('unset') }}"
)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, "effort=unset thinking=unset"),
        ({"reasoning_effort": "low"}, "effort=low thinking=unset"),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, "effort=unset thinking=False"),
        # chat_template_kwargs say it more precisely than the field.
        (
            {"reasoning_effort": "low", "extra_body": {"chat_template_kwargs": {"reasoning_effort": "high"}}},
            "effort=high thinking=unset",
        ),
    ],
)
async def test_reasoning_effort_and_enable_thinking_reach_the_template(kwargs, expected):
    client, engine = scripted("ok", ChatSettings(chat_template=EFFORT_TEMPLATE))
    await create(client, **kwargs)
    assert prompt_text(engine).endswith(expected)


async def test_an_assistants_earlier_thinking_reaches_the_template():
    client, engine = scripted("ok", ChatSettings(chat_template=EFFORT_TEMPLATE))
    history = [*ASK, {"role": "assistant", "content": "4", "reasoning_content": "2+2"}, *ASK]
    await create(client, messages=history)
    assert "assistant: 4 [thought: 2+2]user: 2+2?" in prompt_text(engine)
