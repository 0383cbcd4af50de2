"""The API's own syntax checks of constraints, and how they agree with xgrammar.

The checks must name what is wrong, and must never refuse a constraint the
engine's compiler (xgrammar) accepts: the differential tests below compare
them with xgrammar's tokenizer-free grammar builders.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from services.api.constraint_checks import check_grammar, check_json_schema, check_regex

VALID_REGEXES = [
    r"\d{4}-\d{2}-\d{2}",
    r"[a-z]{3,8}@[a-z]+\.(com|org)",
    r"(?:ab)+c?",
    r"a*?b+?",
    r"[^]",
    r"(?<year>\d{4})",
    r"[\]\-a]",
    r"\p",
    r"a}",
    r"[-a]",
    r"x{2}?",
    r"(|a)",
    "^a$",
]
BAD_REGEXES = [
    ("[a-", "unclosed '[' at position 0"),
    ("(abc", "1 unclosed '('"),
    ("abc)", "unmatched ')' at position 3"),
    ("*a", "'*' at position 0 has nothing to repeat"),
    ("a**", "two repetition operators in a row at position 2"),
    ("a{3,2}", "repetition {3,2} at position 1 has its bounds reversed"),
    ("a{,2}", "invalid repetition count at position 1"),
    ("[z-a]", "character range z-a at position 1 is reversed"),
    ("[]a]", "empty character class at position 0"),
    ("(?=a)b", "lookahead (position 0) is not supported"),
    ("(?<!a)b", "lookbehind (position 0) is not supported"),
    ("(?i)abc", "'(?' groups other than"),
    (r"\bword", "word boundaries"),
    (r"(a)\1", "backreferences"),
    (r"\p{L}", "Unicode property classes"),
    ("abc\\", "unfinished escape"),
]


@pytest.mark.parametrize("pattern", VALID_REGEXES)
def test_valid_regexes_pass(pattern):
    check_regex(pattern)


@pytest.mark.parametrize("pattern, message", BAD_REGEXES)
def test_bad_regexes_are_named(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_regex(pattern)


BAD_SCHEMAS = [
    ([1], "$: a schema must be an object or a boolean, got an array"),
    ({"type": "text"}, "$.type: 'text' is not a JSON type"),
    ({"type": ["string", 3]}, "$.type: 3 is not a JSON type"),
    ({"properties": []}, "$.properties must be an object"),
    ({"properties": {"a": {"items": 3}}}, "$.properties.a.items: a schema must be"),
    ({"enum": []}, "$.enum must be a non-empty array"),
    ({"anyOf": {"type": "string"}}, "$.anyOf must be an array of schemas"),
    ({"type": "array", "maxItems": "3"}, "$.maxItems must be an integer"),
    ({"type": "number", "minimum": True}, "$.minimum must be a number"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "$: minLength (5) is greater than maxLength (2)"),
    ({"type": "string", "pattern": "(x"}, "$.pattern: 1 unclosed '('"),
    ({"$ref": "#/$defs/nope", "$defs": {}}, "$.$ref: '#/$defs/nope' does not point into the schema"),
]


@pytest.mark.parametrize("schema, message", BAD_SCHEMAS, ids=lambda x: json.dumps(x)[:40])
def test_bad_schemas_are_named(schema, message):
    with pytest.raises(ValueError) as info:
        check_json_schema(schema)
    assert str(info.value).startswith(message)


def test_a_rich_schema_passes():
    check_json_schema(
        {
            "type": "object",
            "$defs": {"tag": {"type": "string", "enum": ["a", "b"]}},
            "properties": {
                "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1},
                "id": {"type": ["integer", "null"], "minimum": 0},
                "name": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 20},
                "any": True,
                "either": {"anyOf": [{"type": "string"}, {"type": "number"}]},
            },
            "required": ["tags", "id"],
            "additionalProperties": False,
        }
    )


BAD_GRAMMARS = [
    ('start ::= "a"', "the grammar has no 'root' rule"),
    ('root ::= a\na ::= "x"\na ::= "y"', "line 3, column 1: rule 'a' is defined twice"),
    ('root ::= ("a" | "b"', "1 unclosed '('"),
    ('root ::= "a" )', "line 1, column 14: unmatched ')'"),
    ('root ::= "abc', "line 1, column 10: unterminated string"),
    ("root ::= [a-z", "line 1, column 10: unterminated character class"),
    ("root ::= 'a'", 'line 1, column 10: unexpected character "\'"'),
    ("root ::= item+\n", "rule 'item' is used but never defined"),
    ("root ::=", "the rule before here is empty"),
    ('root ::= "a" ::= "b"', "'::=' must follow a rule name"),
    ('"a"\nroot ::= "b"', "the grammar must start with a rule"),
    ('root ::= "a"{3,1}', "repetition {3,1} has its bounds reversed"),
    ("expr: NUMBER", "the grammar has no 'start' rule"),
    ('start: "a', "unterminated string"),
    ('start: ("a" | "b"', "1 unclosed bracket"),
]


@pytest.mark.parametrize("grammar, message", BAD_GRAMMARS)
def test_bad_grammars_are_named(grammar, message):
    with pytest.raises(ValueError) as info:
        check_grammar(grammar)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+  # digits',
        'root ::= "a" (= "b") "b"',
        'root ::= TagDispatch(("<t>", body))\nbody ::= "x"',
        'root::="a"{2,3}|"b"{2}',
        'start: expr\nexpr: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]+/\n%ignore " "',
    ],
)
def test_valid_grammars_pass(grammar):
    check_grammar(grammar)


# ------------------------------------------------------- against xgrammar


@pytest.fixture(scope="module")
def xgr():
    import xgrammar

    return xgrammar


def _xgrammar_accepts(build, text) -> bool:
    try:
        build(text)
    except Exception:
        return False
    return True


def test_no_regex_xgrammar_accepts_is_refused(xgr):
    rng = random.Random(0)
    alphabet = list("ab()[]{}*+?|^$\\-:<>=!,.dwsbBpPk0123") + ["(?:", "(?<n>", "{2}", "{1,3}", "[a-z]", r"\d"]
    patterns = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(3000)]
    refused_wrongly = []
    for pattern in [*patterns, *VALID_REGEXES, *(p for p, _ in BAD_REGEXES)]:
        try:
            check_regex(pattern)
        except ValueError:
            if _xgrammar_accepts(xgr.Grammar.from_regex, pattern):
                refused_wrongly.append(pattern)
    assert refused_wrongly == []


def test_refused_schemas_and_grammars_are_refused_by_xgrammar_too(xgr):
    for schema, _ in BAD_SCHEMAS:
        assert not _xgrammar_accepts(xgr.Grammar.from_json_schema, json.dumps(schema)), schema
    for grammar, _ in BAD_GRAMMARS:
        build = xgr.Grammar.from_ebnf if "::=" in grammar else xgr.Grammar.from_lark
        assert not _xgrammar_accepts(build, grammar), grammar
    for pattern, _ in BAD_REGEXES:
        assert not _xgrammar_accepts(xgr.Grammar.from_regex, pattern), pattern
