"""Pythonic tool calls (Llama 3.2, Llama 4): the reply is a Python list of calls,
``[get_weather(city="Paris"), f(x=1, y=[1, 2], z={"a": None})]``.

Read with ``ast``, never run: a call's arguments must be keywords whose
values are literals (strings, numbers, booleans, None, and lists, tuples
and dicts of them); anything else means the list is not calls, and the
reply is content. A reply that does not start with ``[name(`` is content
at once; one that does is held until its list closes, then shown as calls
(all of them, or none: content). Text after the list is content. Before
``ast.parse`` sees the text, Python's tokenizer (no recursion) checks it
holds nothing but names, literals and brackets at most ``MAX_DEPTH`` deep,
and a list past ``MAX_CHARS`` characters is content: hostile nesting cannot
exhaust the parser's stack.
"""

from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize

from services.api.tool_parsers.base import ParsedCall, Segment, ToolParser, all_calls

MAX_DEPTH = 32  # brackets inside one another
MAX_CHARS = 256 * 1024  # longest list of calls parsed
# Llama 4 may wrap the list in these (special tokens: usually already left out of the text).
_START, _END = "<|python_start|>", "<|python_end|>"
_OPENING = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_OPENING_SO_FAR = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")
# What the tokenizer may find in a list of calls: a sign only in front of a number
# (so no operator chain nests the tree), no keyword but the three constants.
_OPERATORS = frozenset({"(", ")", "[", "]", "{", "}", ",", ":", "=", "-", "+"})
_BEFORE_SIGN = frozenset({"(", "[", "{", ",", ":", "="})
_CONSTANTS = frozenset({"True", "False", "None"})
_TOKENS = frozenset(
    {tokenize.NUMBER, tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.COMMENT}
)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        # "start" until the reply shows whether it opens a list of calls; "calls"
        # while that list is held until it closes; "closed" just after it; "content"
        # for the rest.
        self.state = "start"
        self.list_end = _ListEnd()

    def split(self, text: str, final: bool) -> tuple[list[Segment], int]:
        if self.state == "start":
            opening = text[_list_start(text) :]
            if _OPENING.match(opening):
                self.state = "calls"
            elif not final and (_START.startswith(text.strip()) or _OPENING_SO_FAR.fullmatch(opening)):
                return [], 0  # too early to tell
            else:
                self.state = "content"
        if self.state == "calls":
            return self._calls(text, final)
        if self.state == "closed":  # Llama 4's end marker may follow the list
            if not final and _END.startswith(text):
                return [], 0
            self.state = "content"
            if text.startswith(_END):
                return [], len(_END)
        return [text], len(text)

    def _calls(self, text: str, final: bool) -> tuple[list[Segment], int]:
        start = _list_start(text)
        end = self.list_end.find(text, start, final)
        if end is None and not final:
            return [], 0  # the list is still being written
        calls = None if end is None or end == NEVER else self._parse(text[start:end])
        if end is None or calls is None:  # never closed, too deep or too long, or not a list of calls
            self.state = "content"
            return [text], len(text)
        self.state = "closed"
        rest, settled = self.split(text[end:], final)
        return [*calls, *rest], end + settled

    def _parse(self, source: str) -> list[ParsedCall] | None:
        """The calls ``source`` lists, or None when it is not such a list."""
        if not _plain(source):
            return None
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        return all_calls([self._call(node) for node in tree.body.elts])

    def _call(self, node: ast.expr) -> ParsedCall | None:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        if any(k.arg is None for k in node.keywords):  # **kwargs
            return None
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
        except ValueError:
            return None
        return self.call_from({"name": node.func.id, "arguments": arguments})


class _ListEnd:
    """Where a list that starts at ``text[start]`` closes: brackets counted
    outside Python strings, each character read once however the text
    arrives (the held text only grows). A decision that needs characters not
    there yet (is ``""`` empty, or a triple quote?) waits for them."""

    def __init__(self) -> None:
        self.pos = 0  # characters read, from the list's start
        self.depth = 0
        self.quote = ""  # the open string's quote (one or three characters), "" outside strings

    def find(self, text: str, start: int, final: bool) -> int | None:
        """The end of the list (after its "]"); None while it is not closed yet;
        NEVER once it nests past MAX_DEPTH or runs past MAX_CHARS."""
        limit = min(len(text), start + MAX_CHARS)  # no copy of the text: it is read in place
        i = start + self.pos
        while i < limit and self.depth <= MAX_DEPTH:
            c = text[i]
            if i + 3 > limit and not final and (c == "\\" or c in "\"'"):
                break  # an escape, or a quote that may be one of three: wait for what follows
            if self.quote:
                if c == "\\":
                    i += 2
                    continue
                if text.startswith(self.quote, i):
                    i += len(self.quote)
                    self.quote = ""
                    continue
            elif c in "\"'":
                self.quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self.quote)
                continue
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1 - start
                    return i + 1
            i += 1
        self.pos = i - start
        return NEVER if self.depth > MAX_DEPTH or self.pos >= MAX_CHARS else None


NEVER = -1  # the list will not close within the limits


def _list_start(text: str) -> int:
    """Where the list begins: past leading space and Llama 4's start marker."""
    stripped = text.lstrip()
    if stripped.startswith(_START):
        stripped = stripped[len(_START) :].lstrip()
    return len(text) - len(stripped)


def _plain(source: str) -> bool:
    """True when ``source`` holds only what a list of calls with literal
    arguments needs, nested at most MAX_DEPTH deep: read by Python's own
    tokenizer (iterative; brackets inside strings do not count). No operator
    but a sign before a number, no keyword but True, False and None: what
    ``ast.parse`` then builds is shallow."""
    depth, previous = 0, ""  # the previous operator, "" after anything else
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if previous in ("-", "+") and token.type != tokenize.NUMBER:
                return False
            if token.type == tokenize.OP:
                sign = token.string in ("-", "+")
                if token.string not in _OPERATORS or sign and previous not in _BEFORE_SIGN:
                    return False  # a sign only in front of a value, never between two
                depth += (token.string in "([{") - (token.string in ")]}")
                if depth > MAX_DEPTH:
                    return False
            elif token.type == tokenize.NAME:
                if keyword.iskeyword(token.string) and token.string not in _CONSTANTS:
                    return False
            elif token.type not in _TOKENS:
                return False
            previous = token.string if token.type == tokenize.OP else ""
    except (tokenize.TokenError, SyntaxError):
        return False
    return True


def _literal(node: ast.expr) -> object:
    """A JSON-ready value of a literal node; ValueError for anything else.
    Recursion is bounded: ``_plain`` capped the nesting before parsing."""
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, (str, bool, int, float))
    ):
        return _finite(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign on something not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):  # {**other}
            raise ValueError("a dict unpacking")
        keys = [_literal(k) for k in node.keys if k is not None]  # none is (checked above)
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    raise ValueError(f"not a literal: {type(node).__name__}")


def _finite(value: object) -> object:
    # JSON has no infinities or NaN (1e999 parses to inf); nor Python's big ints past what JSON readers take.
    if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
        raise ValueError("not a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        raise ValueError("an integer out of range")
    return value
