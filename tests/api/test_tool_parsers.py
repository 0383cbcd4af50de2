"""Tool-call parsers on crafted model text: whole, and streamed split at every position.

The streamed deltas must add up to what the whole text parses to, in
OpenAI's streaming shape (a call's first delta has its id, type and name;
the ones after it only arguments), and malformed calls must come back as
plain content.
"""

from __future__ import annotations

import json
import random

import pytest

from services.api.openai_schemas import ChatTool, FunctionDefinition
from services.api.tool_calling import AutoCalls, NamedCall, NoTools, RequiredCalls, ToolOutput
from services.api.tool_parsers import TOOL_PARSERS, tool_parser_class

TOOLS = tuple(ChatTool(function=FunctionDefinition(name=name)) for name in ("get_weather", "get_time"))
WEATHER = {"city": "Paris", "unit": "celsius"}

HERMES = [
    ("Just words, no calls. 1 < 2 and <b>bold</b>.", "Just words, no calls. 1 < 2 and <b>bold</b>.", []),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        "Let me check.\n",
        [("get_weather", WEATHER)],
    ),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    # Qwen sometimes writes the arguments as JSON text.
    (
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
        None,
        [("get_time", {"tz": "UTC"})],
    ),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
    (
        '<tool_call>{"name": "get_time", "arguments": {}} trailing</tool_call> after',
        '<tool_call>{"name": "get_time", "arguments": {}} trailing</tool_call> after',
        [],
    ),
    (
        'Before <tool_call>{"name": "get_time", "arguments": {}}</tool_call> and after <tool_',
        "Before  and after <tool_",
        [("get_time", {})],
    ),
]

LLAMA3 = [
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (' {"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),
    ('{"answer": 4}', '{"answer": 4}', []),
    (
        '{"name": "get_weather", "parameters": {"city": "Par',
        '{"name": "get_weather", "parameters": {"city": "Par',
        [],
    ),
    ('{"name": "get_time", "parameters": {}} and then some words', "and then some words", [("get_time", {})]),
    ("<|python_tag|>", "", []),
]

# Mistral's two forms: a JSON array after [TOOL_CALLS] (tokenizer v3 templates, with the
# space Mistral 7B v0.3 writes), and [TOOL_CALLS]name[ARGS]{...} per call (v11 on).
MISTRAL = [
    ("It is sunny in Paris [citation].", "It is sunny in Paris [citation].", []),
    (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        'Let me look that up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
        "Let me look that up.",
        [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    ('[TOOL_CALLS]get_time[ARGS] {"tz": "[UTC]"} ', None, [("get_time", {"tz": "[UTC]"})]),
    # Malformed: stays content, and a good call after a bad one is still read.
    ('[TOOL_CALLS]get_weather[ARGS]{"city": }', '[TOOL_CALLS]get_weather[ARGS]{"city": }', []),
    (
        "[TOOL_CALLS] I cannot call a tool for that.[TOOL_CALLS]get_time[ARGS]{}",
        "[TOOL_CALLS] I cannot call a tool for that.",
        [("get_time", {})],
    ),
    (
        '[TOOL_CALLS][{"name": "launch_rockets", "arguments": {}}] done',
        '[TOOL_CALLS][{"name": "launch_rockets", "arguments": {}}] done',
        [],
    ),
    ("[TOOL_CALLS]get_time[ARGS][1, 2]", "[TOOL_CALLS]get_time[ARGS][1, 2]", []),
    (
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}',
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}',
        [],
    ),
    ("Half a marker at the end [TOOL_CA", "Half a marker at the end [TOOL_CA", []),
]

# Llama 3.2 / Llama 4 pythonic calls (Meta's prompt format docs show `[func(param=value)]`).
PYTHONIC = [
    ("Paris is sunny [as usual] today.", "Paris is sunny [as usual] today.", []),
    ('[get_weather(city="Paris", unit="celsius")]', None, [("get_weather", WEATHER)]),
    (
        "[get_weather(city='Paris', unit='celsius'), get_time(tz=\"UTC\", days=[1, 2], "
        'opts={"a": None, "b": (True, -2.5, 1e3)})]',
        None,
        [
            ("get_weather", WEATHER),
            ("get_time", {"tz": "UTC", "days": [1, 2], "opts": {"a": None, "b": [True, -2.5, 1000.0]}}),
        ],
    ),
    (
        '<|python_start|>[get_time(note="a ] inside")]<|python_end|>',
        None,
        [("get_time", {"note": "a ] inside"})],
    ),
    ("[get_time()] and then some words", " and then some words", [("get_time", {})]),
    # Not literals, or not calls: the reply is content, never run.
    ('[get_time(tz=__import__("os").getcwd())]', '[get_time(tz=__import__("os").getcwd())]', []),
    ("[get_time(tz=1 + 1)]", "[get_time(tz=1 + 1)]", []),
    ("[get_time(tz=x)]", "[get_time(tz=x)]", []),
    ('[get_time("UTC")]', '[get_time("UTC")]', []),
    ("[launch_rockets(count=3)]", "[launch_rockets(count=3)]", []),
    ('[get_weather(city="Paris"), oops]', '[get_weather(city="Paris"), oops]', []),
    ('[get_weather(city="Par', '[get_weather(city="Par', []),
    ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
]

CASES = (
    [("hermes", *case) for case in HERMES]
    + [("llama3_json", *case) for case in LLAMA3]
    + [("mistral", *case) for case in MISTRAL]
    + [("pythonic", *case) for case in PYTHONIC]
)


def auto_output(parser: str, parallel: bool = True) -> ToolOutput:
    return AutoCalls(TOOLS, tool_parser_class(parser), parallel).output()


def whole(parser: str, text: str, parallel: bool = True):
    content, calls = auto_output(parser, parallel).complete(text)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def streamed(output: ToolOutput, pieces: list[str]):
    """Feed ``pieces`` as a stream; the content and calls the deltas add up to."""
    content, calls = streamed_text(output, pieces)
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


def streamed_text(output: ToolOutput, pieces: list[str]):
    """``streamed``, with each call's arguments as the text the deltas add up to."""
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        text, deltas = output.feed(piece, done=i == len(pieces) - 1)
        content += text
        for d in deltas:
            if d.index not in calls:  # the first delta names the call
                assert d.id and d.type == "function" and d.function.name
                assert d.index == len(calls)
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.type is None and d.function.name is None
                calls[d.index][1] += d.function.arguments
    return content, [tuple(call) for call in calls.values()]


def assert_same_content(streamed_content: str, content: str | None) -> None:
    # A reply of only calls has no content (None), though whitespace between calls streams.
    if content is None:
        assert streamed_content.strip() == ""
    else:
        assert streamed_content == content


def test_registry_names_every_format():
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="hermes"):
        tool_parser_class("no-such-parser")


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_text(parser, text, content, calls):
    assert whole(parser, text) == (content, calls)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_split_in_two_at_every_position(parser, text, content, calls):
    for k in range(len(text) + 1):
        got_content, got_calls = streamed(auto_output(parser), [text[:k], text[k:], ""])
        assert got_calls == calls, k
        assert_same_content(got_content, content)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_one_character_at_a_time(parser, text, content, calls):
    got_content, got_calls = streamed(auto_output(parser), [*text, ""])
    assert got_calls == calls
    assert_same_content(got_content, content)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_random_pieces(parser, text, content, calls):
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        got_content, got_calls = streamed(auto_output(parser), [*pieces, ""])
        assert got_calls == calls, pieces
        assert_same_content(got_content, content)


def test_content_is_not_held_back_longer_than_needed():
    output = auto_output("hermes")
    assert output.feed("Sunny <tool", done=False) == ("Sunny ", [])  # "<tool" may open a call
    assert output.feed("s are fun", done=False) == ("<tools are fun", [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = HERMES[2][0]
    assert whole("hermes", text, parallel=False) == (None, [("get_weather", WEATHER)])
    for k in range(len(text) + 1):
        assert streamed(auto_output("hermes", parallel=False), [text[:k], text[k:], ""])[1] == [
            ("get_weather", WEATHER)
        ]


REQUIRED = [
    (
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "parameters": {}}]',
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        '[ {"name": "get_time", "parameters": {"tz": "UTC", "note": "a } and a \\" inside"}} ]',
        [("get_time", {"tz": "UTC", "note": 'a } and a " inside'})],
    ),
    # Keys in another order than the schema's: the call shows once it is complete.
    ('[{"parameters": {"tz": "UTC"}, "name": "get_time"}]', [("get_time", {"tz": "UTC"})]),
]
CUT_SHORT = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'


def required_output(parallel: bool = True) -> ToolOutput:
    return RequiredCalls(TOOLS, parallel).output()


@pytest.mark.parametrize("text,calls", REQUIRED)
def test_required_output(text, calls):
    content, got = required_output().complete(text)
    assert (content, [(c.function.name, json.loads(c.function.arguments)) for c in got]) == (None, calls)
    for k in range(len(text) + 1):
        assert streamed(required_output(), [text[:k], text[k:], ""]) == ("", calls), k
    assert streamed(required_output(), [*text, ""]) == ("", calls)


def test_required_streams_a_calls_arguments_as_they_are_written():
    text = REQUIRED[0][0]
    output = required_output()
    named_at, fragments = None, 0
    for i, c in enumerate(text):
        for d in output.feed(c, done=False)[1]:
            if d.function.name == "get_weather":
                named_at = i
            elif d.index == 0 and d.function.arguments:
                fragments += 1
    # The name shows as its parameters' object opens, before the arguments are written.
    assert named_at == text.index("{", text.index('"parameters"'))
    assert fragments == len(json.dumps(WEATHER))  # one fragment per character fed


def test_required_cut_short():
    content, calls = required_output().complete(CUT_SHORT)
    assert content == '{"name": "get_weather", "parameters": {"ci'
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_time", "{}")]
    # A stream already showed the second call's head: its arguments end cut too.
    assert streamed_text(required_output(), [CUT_SHORT, ""]) == (
        "",
        [("get_time", "{}"), ("get_weather", '{"ci')],
    )
    assert streamed_text(required_output(), ['[{"name": "get_ti', ""]) == ('{"name": "get_ti', [])
    assert streamed_text(required_output(), ["", ""]) == ("", [])
    unknown = '[{"name": "launch", "parameters": {}}]'
    assert streamed_text(required_output(), [unknown, ""]) == (unknown[1:], [])  # never shown as a call


def test_required_without_parallel_calls_shows_one():
    text = REQUIRED[0][0]
    assert streamed(required_output(parallel=False), [*text, ""]) == ("", [("get_weather", WEATHER)])
    assert [c.function.name for c in required_output(parallel=False).complete(text)[1]] == ["get_weather"]


def test_named_choice_streams_arguments_as_they_come():
    output = NamedCall(TOOLS[0]).output()
    first, second = output.feed('{"city": ', done=False), output.feed('"Paris"}', done=True)
    [head], [rest] = first[1], second[1]
    assert first[0] == second[0] == ""
    assert (head.index, head.type, head.function.name, head.function.arguments) == (
        0,
        "function",
        "get_weather",
        '{"city": ',
    )
    assert head.id.startswith("chatcmpl-tool-")
    assert (rest.index, rest.id, rest.function.name, rest.function.arguments) == (0, None, None, '"Paris"}')
    assert output.called


def test_no_tool_choice_passes_text_through():
    output = NoTools().output()
    assert output.feed('<tool_call>{"name": "get_time"}</tool_call>', done=True) == (
        '<tool_call>{"name": "get_time"}</tool_call>',
        [],
    )
    assert not output.called


def test_llama3_json_decodes_a_held_object_again_only_when_it_may_have_ended(monkeypatch):
    from services.api.tool_parsers import llama3_json

    attempts, decode = [], llama3_json.decode_json_at

    def counted(text, pos):
        attempts.append(pos)
        return decode(text, pos)

    monkeypatch.setattr(llama3_json, "decode_json_at", counted)
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    assert streamed(auto_output("llama3_json"), [*text, ""]) == ("", [("get_weather", WEATHER)])
    assert len(attempts) <= text.count("}") + 2  # not once per character


HOSTILE_PYTHONIC = [
    "[get_time(tz=" + "[" * 100_000 + "]" * 100_000 + ")]",  # brackets past the tokenizer's own limit
    "[get_time(tz=" + "[" * 40 + "1" + "]" * 40 + ")]",  # past MAX_DEPTH, within Python's
    "[get_time(tz=" + "-" * 200_000 + "1)]",  # a sign chain: the parser's stack
    "[get_time(tz=" + "1+" * 100_000 + "1)]",  # an operator chain: the AST's depth
    "[get_time(tz=" + "not " * 50_000 + "1)]",
    "[get_time(tz=" + "a." * 100_000 + "b)]",
    "[get_time(tz=" + "lambda: " * 30_000 + "1)]",
]


@pytest.mark.parametrize("text", HOSTILE_PYTHONIC, ids=lambda t: t[13:20])
def test_pythonic_refuses_deep_or_active_text_before_parsing_it(text):
    assert whole("pythonic", text) == (text, [])


def test_pythonic_takes_literals_up_to_the_depth_limit():
    from services.api.tool_parsers.pythonic import MAX_DEPTH

    deep = "[" * (MAX_DEPTH - 2) + "1" + "]" * (MAX_DEPTH - 2)  # inside the list and the call
    assert whole("pythonic", f"[get_time(tz={deep})]") == (None, [("get_time", {"tz": json.loads(deep)})])
    assert whole("pythonic", f"[get_time(tz=[{deep}])]")[1] == []


def test_pythonic_gives_up_on_a_list_past_its_size_limit(monkeypatch):
    from services.api.tool_parsers import pythonic

    monkeypatch.setattr(pythonic, "MAX_CHARS", 64)
    text = '[get_time(tz="' + "x" * 100 + '")]'
    assert whole("pythonic", text) == (text, [])
    output = auto_output("pythonic")
    assert output.feed(text[:70], done=False) == (text[:70], [])  # not held past the limit
    assert output.feed(text[70:], done=True) == (text[70:], [])


@pytest.mark.parametrize("text", [MISTRAL[2][0], PYTHONIC[2][0]])
def test_parallel_tool_calls_false_keeps_the_first_call_in_every_format(text):
    parser = "mistral" if "[TOOL_CALLS]" in text else "pythonic"
    first = whole(parser, text)[1][:1]
    assert whole(parser, text, parallel=False)[1] == first
    assert streamed(auto_output(parser, parallel=False), [*text, ""])[1] == first


def test_mistral_call_ids_are_nine_letters_and_digits():
    content, calls = auto_output("mistral").complete(MISTRAL[2][0])
    assert content == "Let me look that up." and len(calls) == 2
    assert all(len(c.id) == 9 and c.id.isalnum() and c.id.isascii() for c in calls)
    assert auto_output("hermes").complete(HERMES[1][0])[1][0].id.startswith("chatcmpl-tool-")


def test_mistral_decodes_held_arguments_again_only_when_they_may_have_ended(monkeypatch):
    from services.api.tool_parsers import mistral

    attempts, decode = [], mistral.decode_json_at

    def counted(text, pos):
        attempts.append(pos)
        return decode(text, pos)

    monkeypatch.setattr(mistral, "decode_json_at", counted)
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius", "days": [1, 2, 3]}'
    assert streamed(auto_output("mistral"), [*text, ""]) == (
        "",
        [("get_weather", {**WEATHER, "days": [1, 2, 3]})],
    )
    assert len(attempts) <= text.count("}") + text.count("]") + 2  # not once per character


def test_new_formats_hold_back_only_what_may_be_a_call():
    mistral = auto_output("mistral")
    assert mistral.feed("Sure [TOOL", done=False) == ("Sure ", [])
    assert mistral.feed("S] are fun", done=False) == ("[TOOLS] are fun", [])
    pythonic = auto_output("pythonic")
    assert pythonic.feed(" [get_wea", done=False) == ("", [])  # may open a list of calls
    assert pythonic.feed("ther is nice]", done=False) == (" [get_weather is nice]", [])
    assert auto_output("pythonic").feed("[1", done=False) == ("[1", [])


DEEP_OBJECT = '{"a": ' * 5000 + "1" + "}" * 5000
DEEP_ARRAY = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", f"<tool_call>{DEEP_OBJECT}</tool_call>"),
        ("llama3_json", DEEP_OBJECT),
        ("mistral", f"[TOOL_CALLS]{DEEP_ARRAY}"),
        ("mistral", f"[TOOL_CALLS]get_time[ARGS]{DEEP_OBJECT}"),
    ],
    ids=["hermes", "llama3_json", "mistral-array", "mistral-args"],
)
def test_json_nested_past_the_recursion_limit_is_content(parser, text):
    assert whole(parser, text) == (text, [])
    assert streamed(auto_output(parser), [text[: len(text) // 2], text[len(text) // 2 :], ""]) == (text, [])
