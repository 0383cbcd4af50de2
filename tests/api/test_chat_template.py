"""The chat-template renderer against transformers' ``apply_chat_template`` (the oracle)."""

from __future__ import annotations

import datetime

import jinja2
import pytest
from transformers import AutoTokenizer

from services.api.chat_args import ChatSettings, add_chat_args, chat_settings_from
from services.api.chat_template import ChatTemplateError, ContinueFinalMessageError, load_chat_template
from services.api.tokenizer import Tokenizer
from tests.api.tool_scripts import TOOL_TEMPLATE

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny in "},
]
# transformers' extras: tojson's arguments, the generation tag, loop controls.
HELPERS_TEMPLATE = (
    "{% for m in messages %}{% generation %}{{ m | tojson(indent=2, sort_keys=true) }}{% endgeneration %}"
    "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    "{{ tools | tojson(separators=(',', ':')) }}{{ extra }}"
)


@pytest.fixture(scope="module")
def tokenizers(default_model):
    return Tokenizer(default_model.hf_dir), AutoTokenizer.from_pretrained(default_model.hf_dir)


CASES = [
    (None, HISTORY[:1], {"add_generation_prompt": True}),
    (None, HISTORY[:1] + [HISTORY[3]], {"add_generation_prompt": False, "continue_final_message": True}),
    (
        TOOL_TEMPLATE,
        HISTORY,
        {"add_generation_prompt": False, "tools": TOOLS, "continue_final_message": True},
    ),
    (TOOL_TEMPLATE, HISTORY[:3], {"add_generation_prompt": True, "tools": TOOLS}),
    (HELPERS_TEMPLATE, HISTORY, {"add_generation_prompt": True, "tools": TOOLS, "extra": "!"}),
]


@pytest.mark.parametrize("template,messages,kwargs", CASES)
def test_renders_as_transformers_does(tokenizers, template, messages, kwargs):
    ours, hf = tokenizers
    expected = hf.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)
    assert ours.apply_chat_template(messages, chat_template=template, **kwargs) == expected


def test_raise_exception_carries_the_templates_message(tokenizers):
    ours, _ = tokenizers
    template = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('No system turn, please.') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError) as error:
        ours.apply_chat_template([{"role": "system", "content": "x"}], chat_template=template)
    assert str(error.value) == "No system turn, please."


def test_strftime_now_is_todays_date(tokenizers):
    ours, _ = tokenizers
    before = datetime.datetime.now().strftime("%Y-%m-%d")
    text = ours.apply_chat_template(HISTORY[:1], chat_template="{{ strftime_now('%Y-%m-%d') }}")
    assert text in {before, datetime.datetime.now().strftime("%Y-%m-%d")}


def test_continue_needs_the_final_message_in_the_text(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(ContinueFinalMessageError):
        ours.apply_chat_template(
            HISTORY[:1],
            add_generation_prompt=False,
            continue_final_message=True,
            chat_template="{% for m in messages %}{{ m.role }}{% endfor %}",
        )


def test_the_sandbox_holds(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(
            HISTORY[:1], chat_template="{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"
        )


def parse(argv: list[str]) -> ChatSettings:
    import argparse

    parser = argparse.ArgumentParser()
    add_chat_args(parser)
    return chat_settings_from(parser.parse_args(argv))


def test_chat_template_flag_reads_a_file_or_an_inline_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TOOL_TEMPLATE)
    assert parse(["--chat-template", str(path)]).chat_template == TOOL_TEMPLATE
    inline = parse(["--chat-template", "{{ messages[0].content }}\\n"])
    assert inline.chat_template == "{{ messages[0].content }}\n"  # escapes read as what they stand for
    assert load_chat_template(str(path)) == TOOL_TEMPLATE


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--chat-template", "no/such/template.jinja"], "looks like a file path"),
        (["--chat-template", "{% for %}"], "does not compile"),
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    ],
)
def test_bad_chat_flags(argv, match):
    with pytest.raises(ValueError, match=match):
        parse(argv)


def test_tool_flags():
    settings = parse(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert settings.auto_parser.name == "llama3_json"
    assert parse(["--tool-call-parser", "hermes"]).auto_parser is None  # auto stays off without the flag
    with pytest.raises(SystemExit):
        parse(["--tool-call-parser", "nope"])
