"""Chat options on /v1/chat/completions: templates, their kwargs, continuing a message, echo."""

from __future__ import annotations

import openai
import pytest

from services.api.chat_args import ChatSettings
from tests.api.fake_engine_client import MODEL_NAME, tokenizer
from tests.api.tool_scripts import END, prompt_text, scripted

PARTIAL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def create(client, messages=PARTIAL, **extra):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=20, extra_body={"stop_token_ids": END, **extra}
    )


async def assert_400(call, param: str, message: str | None = None) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        await call
    assert error.value.status_code == 400 and error.value.body["param"] == param
    if message is not None:
        assert error.value.body["message"] == message


async def test_continue_final_message_conflicts_with_a_generation_prompt():
    client, engine = scripted(" blue")
    await assert_400(create(client, continue_final_message=True), "continue_final_message")
    assert engine.requests == []


async def test_continue_final_message_leaves_the_turn_open():
    client, engine = scripted(" blue.")
    reply = await create(client, **CONTINUE)
    # The model's own template renders the partial turn without closing it.
    expected = tokenizer().apply_chat_template(
        PARTIAL, add_generation_prompt=False, continue_final_message=True
    )
    assert prompt_text(engine) == expected and expected.endswith("<|im_start|>assistant\nMy favourite is")
    [choice] = reply.choices
    assert (choice.message.role, choice.message.content) == ("assistant", " blue.")


async def test_echo_puts_the_continued_message_first():
    client, _ = scripted(" blue.")
    assert (await create(client, echo=True, **CONTINUE)).choices[0].message.content == "My favourite is blue."
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=PARTIAL,
        max_tokens=20,
        stream=True,
        extra_body={"stop_token_ids": END, "echo": True, **CONTINUE},
    )
    deltas = [c.choices[0].delta async for c in stream]
    assert deltas[0].role == "assistant" and deltas[1].content == "My favourite is"
    assert "".join(d.content or "" for d in deltas) == "My favourite is blue."


async def test_echo_after_a_user_message_adds_nothing():
    # vLLM: only a final message in the reply's own role is echoed.
    client, _ = scripted("Blue.")
    reply = await create(client, messages=PARTIAL[:1], echo=True)
    assert reply.choices[0].message.content == "Blue."


async def test_without_a_generation_prompt_the_reply_keeps_the_final_role():
    client, _ = scripted(" more")
    reply = await create(client, messages=PARTIAL[:1], add_generation_prompt=False)
    assert reply.choices[0].message.role == "user"  # vLLM's rule


GREETING = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"


async def test_chat_template_kwargs_reach_the_template():
    client, engine = scripted("ok", ChatSettings(chat_template=GREETING))
    await create(client, messages=PARTIAL[:1], chat_template_kwargs={"greeting": "Bonjour! "})
    assert prompt_text(engine) == "Bonjour! Name a colour."


async def test_chat_template_kwargs_may_not_replace_the_requests_own_fields():
    client, engine = scripted("ok")
    await assert_400(create(client, chat_template_kwargs={"messages": []}), "chat_template_kwargs")
    assert engine.requests == []


async def test_a_requests_chat_template_needs_the_servers_trust():
    client, engine = scripted("ok")
    await assert_400(create(client, chat_template=GREETING), "chat_template")
    trusted, engine = scripted("ok", ChatSettings(trust_request_chat_template=True))
    await create(
        trusted, messages=PARTIAL[:1], chat_template=GREETING, chat_template_kwargs={"greeting": "Hi. "}
    )
    assert prompt_text(engine) == "Hi. Name a colour."
    await assert_400(create(trusted, chat_template="{% for m in messages %}"), "chat_template")


async def test_server_chat_template_replaces_the_models():
    client, engine = scripted("ok", ChatSettings(chat_template="[{{ messages[-1].content }}]"))
    await create(client, messages=PARTIAL[:1])
    assert prompt_text(engine) == "[Name a colour.]"


async def test_raise_exception_is_a_400_with_the_templates_message():
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Start with a user turn.') }}{% endif %}"
    )
    client, engine = scripted("ok", ChatSettings(chat_template=template))
    await assert_400(create(client, messages=PARTIAL[1:]), "messages", "Start with a user turn.")
    assert engine.requests == []


async def test_tokenize_renders_with_the_same_options():
    client, _ = scripted("ok", ChatSettings(chat_template="{{ tools | length if tools else '' }}" + GREETING))
    http = client._client  # the app's httpx client, for a route the SDK has no method for
    body = {
        "messages": PARTIAL,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"greeting": "Hey. "},
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    response = await http.post("http://test/tokenize", json=body)
    assert response.status_code == 200
    assert tokenizer().decode(response.json()["tokens"]) == "1Hey. Name a colour.My favourite is"
    response = await http.post("http://test/tokenize", json={**body, "add_generation_prompt": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"
