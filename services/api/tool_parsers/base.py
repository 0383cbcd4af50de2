"""The interface of a tool-call parser: model text in, text and calls out.

A parser only splits text. ``split(text, final)`` returns the segments of a
settled prefix of ``text`` (plain text, or a call it parsed) and where that
prefix ends; what follows may still turn into a call, so a stream holds it
back until more text (or the end) settles it, and the next call's ``text``
starts there. One instance reads one reply (it may remember what it read,
such as whether the reply began as calls). The complete parse and the
streamed one are the same function applied to the same text, so they agree
by construction. A call that does not parse, names a function the request
did not offer, or never closes stays plain text: never an error.
"""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


Segment = str | ParsedCall


class ToolParser(abc.ABC):
    name: ClassVar[str]
    # True when the calls' markers are special tokens, which the reply's text
    # must keep (skip_special_tokens off) for the parser to see them.
    keeps_special_tokens: ClassVar[bool] = False

    @staticmethod
    def new_call_id() -> str:
        """A fresh id for a call this parser found (the model family may need its own shape)."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names

    @abc.abstractmethod
    def split(self, text: str, final: bool) -> tuple[list[Segment], int]:
        """The segments of ``text[:settled]``, and ``settled``. With ``final``
        the text is complete and all of it is settled."""

    def call_from(
        self, value: object, arg_keys: tuple[str, ...] = ("arguments", "parameters")
    ) -> ParsedCall | None:
        """The call a decoded JSON value describes, or None if it is not one of this request's tools."""
        if not isinstance(value, dict) or value.get("name") not in self.tool_names:
            return None
        key = next((k for k in arg_keys if k in value), None)
        arguments = {} if key is None else value[key]
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def all_calls(calls: list[ParsedCall | None]) -> list[ParsedCall] | None:
    """``calls`` when every one is a call, else None (one item that is not makes the whole text content)."""
    found = [c for c in calls if c is not None]
    return found if len(found) == len(calls) else None


def partial_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with
    (text a stream must hold back: it may be the start of the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def decode_json_at(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON value starting at ``pos`` and where it ends, or None if none is complete there
    (or it nests past the interpreter's recursion limit, which the decoder checks: a model
    can be made to write ``[[[[...``)."""
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None
