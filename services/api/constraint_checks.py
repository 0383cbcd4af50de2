"""Cheap syntax checks of structured-output constraints, in the API process.

The grammar library (xgrammar) imports torch, which the API process must
not load, so these checks are our own. They refuse what the engine's
compiler would certainly refuse -- an unclosed group, a repetition with
nothing to repeat, a JSON Schema keyword of the wrong type, an undefined
grammar rule -- so the client gets a 400 naming the problem before anything
is scheduled. They aim never to refuse a constraint the compiler accepts;
whatever they miss, the engine's compile still reports as the request's
error.

Every check raises ``ValueError`` with a message that says what is wrong.
Each runs on client input, so each is linear in its input and refuses
anything over ``MAX_CONSTRAINT_CHARS`` before looking at it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# The largest regex, grammar or schema text checked (a constraint of this
# size already takes the engine's compiler seconds).
MAX_CONSTRAINT_CHARS = 128 * 1024


def check_size(text: str, what: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"the {what} is {len(text)} characters long; this server checks at most {MAX_CONSTRAINT_CHARS}"
        )


# ---------------------------------------------------------------- regexes

_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")
_NAMED_GROUP = re.compile(r"\(\?<([A-Za-z_][A-Za-z0-9_]*)>")

# What the regex scanner saw last: where a repetition operator may go.
_START, _ATOM, _QUANTIFIED, _LAZY = range(4)


def check_regex(pattern: str) -> None:
    """A regular expression in the dialect xgrammar compiles (ECMAScript-like)."""
    check_size(pattern, "regex")
    i, depth, last = 0, 0, _START
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            _check_escape(pattern, i)
            i, last = i + 2, _ATOM
        elif c == "[":
            i, last = _class_end(pattern, i) + 1, _ATOM
        elif c == "(":
            i, depth, last = _group_body_start(pattern, i), depth + 1, _START
        elif c == ")":
            if depth == 0:
                raise ValueError(f"unmatched ')' at position {i}")
            i, depth, last = i + 1, depth - 1, _ATOM
        elif c in "*+?{":
            i, last = _repetition_end(pattern, i, last)
        else:
            i, last = i + 1, _START if c == "|" else _ATOM
    if depth:
        raise ValueError(f"{depth} unclosed '(' (missing ')')")


def _repetition_end(pattern: str, i: int, last: int) -> tuple[int, int]:
    c = pattern[i]
    if c == "?" and last == _QUANTIFIED:
        return i + 1, _LAZY  # a lazy quantifier: a*?
    if last in (_QUANTIFIED, _LAZY):
        raise ValueError(f"two repetition operators in a row at position {i}")
    if last == _START:
        raise ValueError(f"'{c}' at position {i} has nothing to repeat")
    return (_quantifier_end(pattern, i) if c == "{" else i + 1), _QUANTIFIED


def _check_escape(pattern: str, i: int) -> None:
    if i + 1 == len(pattern):
        raise ValueError("the pattern ends with an unfinished escape '\\'")
    e = pattern[i + 1]
    if e in "bB":
        raise ValueError(f"word boundaries (\\{e}, position {i}) are not supported")
    if e in "pP" and pattern.startswith("{", i + 2):
        raise ValueError(f"Unicode property classes (\\{e}{{...}}, position {i}) are not supported")
    if e in "123456789" or (e == "k" and pattern.startswith("<", i + 2)):
        raise ValueError(f"backreferences (position {i}) are not supported")


def _group_body_start(pattern: str, i: int) -> int:
    """Index just past a group's opening: ``(``, ``(?:`` or ``(?<name>``."""
    if not pattern.startswith("(?", i):
        return i + 1
    if pattern.startswith("(?:", i):
        return i + 3
    if pattern.startswith(("(?=", "(?!"), i):
        raise ValueError(f"lookahead (position {i}) is not supported")
    if pattern.startswith(("(?<=", "(?<!"), i):
        raise ValueError(f"lookbehind (position {i}) is not supported")
    named = _NAMED_GROUP.match(pattern, i)
    if named is None:
        raise ValueError(f"'(?' groups other than (?:...) and (?<name>...) are not supported (position {i})")
    return named.end()


def _class_end(pattern: str, start: int) -> int:
    """Index of the ']' that closes the character class opened at ``start``."""
    i = start + 1
    negated = pattern.startswith("^", i)
    i += negated
    if pattern.startswith("]", i):
        if negated:
            return i  # [^]: any character
        raise ValueError(f"empty character class at position {start}")
    previous: str | None = None  # the last single character, a possible range start
    while i < len(pattern) and pattern[i] != "]":
        if pattern[i] == "\\":
            previous, i = None, i + 2
        elif pattern[i] == "-" and previous is not None and pattern[i + 1 : i + 2] not in ("", "]", "\\"):
            if ord(pattern[i + 1]) < ord(previous):
                raise ValueError(
                    f"character range {previous}-{pattern[i + 1]} at position {i - 1} is reversed"
                )
            previous, i = None, i + 2
        else:
            previous, i = pattern[i], i + 1
    if i >= len(pattern):
        raise ValueError(f"unclosed '[' at position {start}")
    return i


def _quantifier_end(pattern: str, i: int) -> int:
    match = _QUANTIFIER.match(pattern, i)
    if match is None:
        raise ValueError(f"invalid repetition count at position {i} (write {{m}}, {{m,}} or {{m,n}})")
    low, high = int(match.group(1)), match.group(3)
    if high and int(high) < low:
        raise ValueError(f"repetition {{{low},{high}}} at position {i} has its bounds reversed")
    return match.end()


# ------------------------------------------------------------ JSON Schema

_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_BOUNDS = (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"))
_MAX_SCHEMA_DEPTH = 128


def check_json_schema(schema: object) -> None:
    """A JSON Schema (already parsed from its JSON text)."""
    _check_schema(schema, "$", schema, 0)


def _check_schema(schema: object, path: str, root: object, depth: int) -> None:
    if depth > _MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests deeper than {_MAX_SCHEMA_DEPTH} levels")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: a schema must be an object or a boolean, got {_json_type(schema)}")
    _check_keywords(schema, path, root)
    for key, sub in _subschemas(schema, path):
        _check_schema(sub, f"{path}.{key}", root, depth + 1)


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[str, object]]:
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if key == "properties" and value is not None and not isinstance(value, dict):
            raise ValueError(f"{path}.properties must be an object")
        if isinstance(value, dict):
            yield from ((f"{key}.{name}", sub) for name, sub in value.items())
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if key != "prefixItems" and value is not None and not isinstance(value, list):
            raise ValueError(f"{path}.{key} must be an array of schemas")
        if isinstance(value, list):
            yield from ((f"{key}[{i}]", sub) for i, sub in enumerate(value))
    for key in _SCHEMA_VALUES:
        if key in schema:
            yield key, schema[key]


def _check_keywords(schema: dict[str, Any], path: str, root: object) -> None:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if not isinstance(k, str) or k not in _JSON_TYPES:
            raise ValueError(
                f"{path}.type: {k!r} is not a JSON type (allowed: {', '.join(sorted(_JSON_TYPES))})"
            )
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ValueError(f"{path}.enum must be a non-empty array")
    for key in _COUNTS:
        if key in schema and (type(schema[key]) is not int):
            raise ValueError(f"{path}.{key} must be an integer")
    for key in _NUMBERS:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], (int, float))):
            raise ValueError(f"{path}.{key} must be a number")
    for low, high in _BOUNDS:
        if low in schema and high in schema and schema[low] > schema[high]:
            raise ValueError(f"{path}: {low} ({schema[low]}) is greater than {high} ({schema[high]})")
    if isinstance(schema.get("pattern"), str):
        try:
            check_regex(schema["pattern"])
        except ValueError as e:
            raise ValueError(f"{path}.pattern: {e}") from None
    if "$ref" in schema:
        _check_ref(schema["$ref"], path, root)


def _check_ref(ref: object, path: str, root: object) -> None:
    """A local reference (``#/...``) must lead somewhere; others are left to the compiler."""
    if not isinstance(ref, str):
        raise ValueError(f"{path}.$ref must be a string")
    if not ref.startswith("#/"):
        return
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"{path}.$ref: {ref!r} does not point into the schema")


def _json_type(value: object) -> str:
    return {str: "a string", int: "a number", float: "a number", list: "an array"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


# --------------------------------------------------------------- grammars

# One EBNF token: a comment, a string, a character class, '::=', a name, or one character.
_EBNF_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*")
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<assign>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<repeat>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<char>[|*+?(),=])
""",
    re.VERBOSE,
)


def check_grammar(grammar: str) -> None:
    """An EBNF grammar (rules ``name ::= ...``, entry ``root``), or a Lark one (entry ``start``)."""
    check_size(grammar, "grammar")
    if "::=" in grammar:
        _check_ebnf(grammar)
    else:
        _check_lark(grammar)


def _ebnf_tokens(grammar: str) -> list[tuple[str, str, int]]:
    """(kind, text, position) of each token, comments and spaces dropped."""
    tokens, i = [], 0
    while i < len(grammar):
        match = _EBNF_TOKEN.match(grammar, i)
        if match is None:
            raise ValueError(f"{_where(grammar, i)}: {_describe(grammar, i)}")
        kind = match.lastgroup
        assert kind is not None  # every alternative of _EBNF_TOKEN is a named group
        if kind != "space":
            tokens.append((kind, match.group(), i))
        i = match.end()
    return tokens


def _check_ebnf(grammar: str) -> None:
    tokens = _ebnf_tokens(grammar)
    defined: dict[str, int] = {}  # rule name -> where its definition starts
    referenced: list[tuple[str, int]] = []
    depth, body_len = 0, 0  # of the rule being read
    for index, (kind, text, pos) in enumerate(tokens):
        following = tokens[index + 1] if index + 1 < len(tokens) else ("", "", -1)
        if kind == "name" and following[0] == "assign":
            _end_rule(grammar, pos, depth, body_len, defined)
            if text in defined:
                raise ValueError(f"{_where(grammar, pos)}: rule {text!r} is defined twice")
            defined[text], depth, body_len = pos, 0, 0
        elif kind == "assign":
            if index == 0 or tokens[index - 1][0] != "name":
                raise ValueError(f"{_where(grammar, pos)}: '::=' must follow a rule name")
        elif not defined:
            raise ValueError(f"{_where(grammar, pos)}: the grammar must start with a rule (name ::= ...)")
        else:
            body_len += 1
            depth += (text == "(") - (text == ")")
            if depth < 0:
                raise ValueError(f"{_where(grammar, pos)}: unmatched ')'")
            if kind == "repeat":
                _check_repeat_bounds(grammar, text, pos)
            # A name right before '(' calls a macro (TagDispatch(...)); others name rules.
            if kind == "name" and not (following[1] == "(" and following[2] == pos + len(text)):
                referenced.append((text, pos))
    _end_rule(grammar, len(grammar), depth, body_len, defined)
    _check_rule_names(grammar, defined, referenced)


def _end_rule(grammar: str, pos: int, depth: int, body_len: int, defined: dict[str, int]) -> None:
    if not defined:
        return
    if depth > 0:
        raise ValueError(f"{_where(grammar, pos)}: {depth} unclosed '(' in the rule before here")
    if body_len == 0:
        raise ValueError(f"{_where(grammar, pos)}: the rule before here is empty")


def _check_repeat_bounds(grammar: str, text: str, pos: int) -> None:
    low, _, high = text.strip("{} ").partition(",")
    if high.strip() and int(high) < int(low):
        raise ValueError(f"{_where(grammar, pos)}: repetition {text} has its bounds reversed")


def _check_rule_names(grammar: str, defined: dict[str, int], referenced: list[tuple[str, int]]) -> None:
    if "root" not in defined:
        raise ValueError("the grammar has no 'root' rule (root ::= ...), where matching starts")
    for name, pos in referenced:
        if name not in defined:
            raise ValueError(f"{_where(grammar, pos)}: rule {name!r} is used but never defined")


# Lark: strings, regexes and comments, then brackets; nothing else is checked.
# Runs of other characters are one token, so the loop below steps per token, not per character.
_LARK_TOKEN = re.compile(
    r'"(?:\\.|[^"\\\n])*"i?|/(?:\\.|[^/\\\n])+/[imslux]*|//[^\n]*'
    r'|[^"/()\[\]]+|[^"/]'
)
# The start rule at a line start. Only blanks other than '\n' may lead: a
# leading \s* would run over every following empty line from each line
# start (quadratic in the number of lines); the later line start matches anyway.
_LARK_START = re.compile(r"^[^\S\n]*[?!]?start\s*:", re.MULTILINE)


def _check_lark(grammar: str) -> None:
    if not _LARK_START.search(grammar):
        raise ValueError(
            "the grammar has no 'start' rule (start: ...), where matching starts "
            "(or write EBNF: root ::= ...)"
        )
    depth, i = 0, 0
    while i < len(grammar):
        match = _LARK_TOKEN.match(grammar, i)
        if match is None:
            raise ValueError(f"{_where(grammar, i)}: {_describe(grammar, i)}")
        depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(match.group(), 0)
        if depth < 0:
            raise ValueError(f"{_where(grammar, i)}: unmatched {match.group()!r}")
        i = match.end()
    if depth:
        raise ValueError(f"{depth} unclosed bracket(s) in the grammar")


def _where(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"line {line}, column {column}"


def _describe(text: str, pos: int) -> str:
    """What is wrong with the token that starts at ``pos``."""
    unterminated = {
        '"': 'unterminated string (missing closing ")',
        "[": "unterminated character class (missing ']')",
        "/": "unterminated regular expression (missing closing /)",
    }
    return unterminated.get(text[pos], f"unexpected character {text[pos]!r}")
