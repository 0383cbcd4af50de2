"""The reasoning parsers on whole replies and on the same replies streamed in every kind of piece."""

from __future__ import annotations

import random

import pytest

from services.api.chat_args import ChatSettings
from services.api.reasoning_parsers import REASONING_PARSERS, reasoning_parser_class

# (reply, deepseek_r1's (reasoning, content), qwen3's)
CASES = [
    ("<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4."), ("Let me see.", "It is 4.")),
    ("\n<think>\nA</think>\n\nB", ("\nA", "\n\nB"), ("\nA", "\n\nB")),
    # R1's template opens the tag in the prompt: the reply only closes it.
    ("Let me see.</think>It is 4.", ("Let me see.", "It is 4."), (None, "Let me see.</think>It is 4.")),
    ("It is 4.", ("It is 4.", None), (None, "It is 4.")),
    # Cut before the tag closed: thinking to the end.
    ("<think>Let me", ("Let me", None), ("Let me", None)),
    ("<think></think>Four.", (None, "Four."), (None, "Four.")),
    (
        "<think>a < b and c </ d</think>x</think>y",
        ("a < b and c </ d", "x</think>y"),
        ("a < b and c </ d", "x</think>y"),
    ),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("", (None, None), (None, None)),
    ("Say <think>x</think>", ("Say <think>x", None), (None, "Say <think>x</think>")),
]


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = (
        sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 6))))
        if len(text) > 1
        else []
    )
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def streamed(name: str, chunks: list[str]) -> tuple[str | None, str | None]:
    parser = reasoning_parser_class(name)()
    reasoning = content = ""
    for i, chunk in enumerate(chunks):
        r, c = parser.feed(chunk, final=i == len(chunks) - 1)
        reasoning, content = reasoning + r, content + c
    if not chunks:
        reasoning, content = parser.feed("", final=True)
    return reasoning or None, content or None


@pytest.mark.parametrize("name, column", [("deepseek_r1", 1), ("qwen3", 2)])
@pytest.mark.parametrize("case", CASES, ids=[repr(c[0]) for c in CASES])
def test_whole_and_streamed_replies_split_the_same(name, column, case):
    text, expected = case[0], case[column]
    assert reasoning_parser_class(name)().split(text) == expected
    assert streamed(name, list(text)) == expected  # one character at a time
    rng = random.Random(text)
    for _ in range(20):
        assert streamed(name, pieces(text, rng)) == expected
    # The end may come as an empty last piece after the text.
    assert streamed(name, [*list(text), ""]) == expected


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_a_split_tag_is_held_back_until_it_settles(name):
    parser = reasoning_parser_class(name)()
    assert parser.feed("<thi", final=False) == ("", "")
    assert parser.feed("nk>Hmm", final=False) == ("Hmm", "")
    assert parser.feed(" ok</th", final=False) == (" ok", "")
    assert parser.feed("ink>Yes", final=False) == ("", "Yes")
    assert parser.feed("</think>", final=True) == ("", "</think>")


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ChatSettings(reasoning_parser="r2")
