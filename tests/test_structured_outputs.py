"""Guided decoding on the real default model, through the offline ``LLM``.

Every constrained output must be text its constraint accepts, checked by
independent means: ``re.fullmatch``, the ``jsonschema`` package, ``json``,
and a small arithmetic parser written here.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

REVIEWS = [
    "I loved every minute of it.",
    "Terrible, a waste of money.",
    "Best purchase this year!",
    "It broke after two days.",
    "Wonderful service and friendly staff.",
    "Never again.",
    "Exceeded my expectations.",
    "The food was cold and bland.",
    "Absolutely fantastic.",
    "Rude staff, long wait.",
    "Five stars, would recommend.",
    "Disappointing sequel.",
    "A delightful surprise.",
    "Worst hotel I have stayed in.",
    "Great value for the price.",
    "Meh, it was fine I guess.",
]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}

# Bounded, so a sampled expression always ends well inside max_tokens.
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" num ("+" | "-" | "*") num ")"
num ::= [1-9] [0-9]{0,2}
"""


# A fixed pool (16 sequences of 1024 tokens) instead of profiling a 2048-token step:
# sizing the cache is tested in tests/worker/test_worker.py.
ENGINE = dict(dtype="float32", max_model_len=1024, num_threads=1, num_gpu_blocks_override=1025, block_size=16)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(**ENGINE)
    yield engine
    engine.shutdown()


def chat(llm: LLM, questions: list[str], params: SamplingParams | list[SamplingParams]):
    return llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)


def constrained(
    temperature: float = 1.0, max_tokens: int = 32, seed: int | None = None, **kwargs
) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
        structured_outputs=StructuredOutputsParams(**kwargs),
    )


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def assert_no_leaks(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_manager.all_blocks_free()


def test_choice_at_temperature_one_over_16_prompts(llm):
    choices = ["Positive", "Negative"]
    outputs = chat(
        llm,
        [f"Is this review positive or negative? {r}" for r in REVIEWS],
        [constrained(choice=choices, seed=i) for i in range(16)],
    )
    assert all(text in choices for text in texts(outputs)), texts(outputs)
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop"}
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "pattern, question",
    [
        (r"\d{4}-\d{2}-\d{2}", "When did the first moon landing happen? Give the date."),
        (r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", "Make up an e-mail address."),
        (r"\d{3}-\d{4}", "Give me a phone number."),
    ],
)
def test_regex_outputs_fully_match(llm, pattern, question):
    outputs = chat(llm, [question] * 4, [constrained(regex=pattern, seed=i) for i in range(4)])
    for text in texts(outputs):
        assert re.fullmatch(pattern, text), (pattern, text)


def test_json_schema_samples_validate_at_temperature_one(llm):
    question = "Describe a member of our team as JSON."
    outputs = chat(
        llm,
        [question] * 16,
        [
            constrained(json=PERSON_SCHEMA, disable_any_whitespace=True, max_tokens=200, seed=i)
            for i in range(16)
        ],
    )
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON_SCHEMA)
    assert_no_leaks(llm)


def test_json_schema_greedy_with_free_whitespace_and_json_object(llm):
    [schema_out, object_out] = chat(
        llm,
        [
            "Describe a member of our team as JSON.",
            "Give a JSON object with a single key 'answer' holding the number 42.",
        ],
        [
            constrained(temperature=0, max_tokens=200, json=PERSON_SCHEMA),
            constrained(temperature=0, max_tokens=100, json_object=True, disable_any_whitespace=True),
        ],
    )
    jsonschema.validate(json.loads(schema_out.outputs[0].text), PERSON_SCHEMA)
    assert isinstance(json.loads(object_out.outputs[0].text), dict)


class ArithmeticParser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := number | '(' expr ')'. Written independently of the grammar."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def parse(self) -> float:
        value = self.expr()
        if self.pos != len(self.text):
            raise ValueError(f"unexpected {self.text[self.pos :]!r}")
        return value

    def expr(self) -> float:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            value = value + self.term() if op == "+" else value - self.term()
        return value

    def term(self) -> float:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.factor()
            value = value * right if op == "*" else value / right
        return value

    def factor(self) -> float:
        if self.peek() == "(":
            self.take()
            value = self.expr()
            if self.take() != ")":
                raise ValueError("missing )")
            return value
        digits = re.match(r"\d+", self.text[self.pos :])
        if digits is None:
            raise ValueError(f"expected a number at {self.pos}")
        self.pos += digits.end()
        return float(digits.group())

    def peek(self) -> str:
        return self.text[self.pos : self.pos + 1]

    def take(self) -> str:
        c = self.peek()
        self.pos += 1
        return c


def test_ebnf_arithmetic_outputs_parse(llm):
    assert ArithmeticParser("(1+2)*3-40/5").parse() == 1.0
    with pytest.raises(ValueError):
        ArithmeticParser("1+*2").parse()
    outputs = chat(
        llm,
        ["Write a small arithmetic expression."] * 6,
        [constrained(grammar=ARITHMETIC, max_tokens=128, seed=i) for i in range(6)],
    )
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        ArithmeticParser(output.outputs[0].text).parse()


def test_unconstrained_neighbours_keep_their_greedy_text(llm):
    plain = SamplingParams(temperature=0, max_tokens=24)
    questions = ["What is the capital of France?", "Name three colours.", "Count to five."]
    alone = chat(llm, questions, plain)
    mixed = chat(
        llm,
        ["Pick one.", questions[0], "Date?", questions[1], questions[2]],
        [constrained(choice=["red", "blue"]), plain, constrained(regex=r"\d{4}"), plain, plain],
    )
    assert [o.outputs[0].token_ids for o in alone] == [mixed[i].outputs[0].token_ids for i in (1, 3, 4)]
    assert texts(mixed)[0] in ("red", "blue") and re.fullmatch(r"\d{4}", texts(mixed)[2])


def test_a_bad_or_slow_grammar_fails_only_its_own_request(llm):
    manager = llm.engine.scheduler.structured_output_manager
    timeout, manager.compile_timeout = manager.compile_timeout, 0.25
    try:
        outputs = chat(
            llm,
            ["Say hi.", "Letters.", "Count to three.", "Lookahead."],
            [
                SamplingParams(temperature=0, max_tokens=8),
                constrained(regex="[a-z]{1,3000}"),  # compiles for about a second: past 0.25 s
                SamplingParams(temperature=0, max_tokens=8),
                constrained(regex="(?=a)b"),  # xgrammar has no lookahead
            ],
        )
    finally:
        manager.compile_timeout = timeout
    ok, slow, ok2, bad = (o.outputs[0] for o in outputs)
    assert ok.finish_reason == ok2.finish_reason == "length" and ok.text and ok2.text
    assert slow.finish_reason == "error" and "took longer than 0.25s" in slow.error
    assert bad.finish_reason == "error" and "Lookahead is not supported" in bad.error
    assert_no_leaks(llm)


def test_constrained_outputs_validate_with_speculative_decoding():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(**ENGINE, speculative_config=spec)
    try:
        schema = {
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"type": "string", "enum": ["ab", "cd"]}, "maxItems": 6}
            },
            "required": ["items"],
        }
        executor, steps = llm.engine.executor, []
        execute = executor.execute_model
        executor.execute_model = lambda so: steps.append(so) or execute(so)
        outputs = chat(
            llm,
            ['Repeat: {"items": ["ab", "cd", "ab", "cd"]}'] * 2 + ["A date?"],
            [
                constrained(temperature=0, max_tokens=48, json=schema, disable_any_whitespace=True),
                constrained(max_tokens=48, json=schema, disable_any_whitespace=True, seed=1),
                constrained(regex=r"\d{4}-\d{2}-\d{2}", seed=3),
            ],
        )
        # Drafts were verified under grammar masks: one mask row per draft, plus one.
        assert any(
            so.scheduled_spec_decode_tokens
            and so.grammar_bitmask is not None
            and len(so.grammar_bitmask) > len(so.structured_output_request_ids)
            for so in steps
        )
        for output in outputs[:2]:
            jsonschema.validate(json.loads(output.outputs[0].text), schema)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", outputs[2].outputs[0].text)
        assert_no_leaks(llm)
    finally:
        llm.shutdown()
