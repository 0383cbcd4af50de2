"""The text ``tool_choice: "required"`` forces: ``[{"name": N, "parameters": {...}}, ...]``.

The JSON schema (``tool_calling.required_schema``) makes the engine write
exactly this shape, so a stream can show each call as it is written: its
name as soon as ``"parameters":`` follows it, then the parameters' JSON
text fragment by fragment. Nothing shown is taken back; only a reply cut
short by ``max_tokens`` ends inside a call, whose arguments are then cut
too (the whole reply shows such a call as content instead).
"""

from __future__ import annotations

import json
import re

from services.api.tool_parsers.base import Segment, ToolParser, decode_json_at

# A call's head, when the schema's key order held: the name, then the start of an object.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(?=\{)')
_BETWEEN = " \t\n\r,}"  # what may separate calls: whitespace, commas, the last call's closing brace
_WHITESPACE = " \t\n\r"

# What a stream shows: (call index, its name when this starts it else None, arguments text).
Piece = tuple[int, str | None, str]


class RequiredCallsParser(ToolParser):
    """The whole reply's calls (a call cut short stays text)."""

    name = "required"

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.opened = False  # the array's "[" was read

    def split(self, text: str, final: bool) -> tuple[list[Segment], int]:
        pos = 0
        if not self.opened:
            pos = _skip(text, 0, _WHITESPACE)
            if pos == len(text) and not final:
                return [], 0
            if not text.startswith("[", pos):
                return [text], len(text)  # cut short before it began
            self.opened, pos = True, pos + 1
        return self._calls(text, pos, final)

    def _calls(self, text: str, pos: int, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        while True:
            pos = _skip(text, pos, " \t\n\r,")
            decoded = decode_json_at(text, pos)
            call = None if decoded is None else self.call_from(decoded[0], ("parameters",))
            if decoded is not None and call is not None:
                segments.append(call)
                pos = decoded[1]
                continue
            if not final:
                return segments, pos
            if text[pos:].strip() not in ("]", ""):
                segments.append(text[pos:])  # cut short (max_tokens) inside a call
            return segments, len(text)


class _ObjectEnd:
    """Finds where a JSON object ends, reading it piece by piece."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str) -> int | None:
        """How much of ``text`` the object takes when it ends in it, else None (all of it is the object's)."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class RequiredCallsStream:
    """Streams a required choice's calls: ``feed`` returns (content, [(index, name or None, arguments)])
    where a name starts call ``index`` and arguments continue it."""

    def __init__(self, tool_names: frozenset[str], max_calls: int | None = None) -> None:
        self.parser = RequiredCallsParser(tool_names)
        self.max_calls = max_calls
        self.pending = ""  # text read but not shown
        self.opened = False
        self.arguments: _ObjectEnd | None = None  # set while a call's parameters stream
        self.num_calls = 0

    def feed(self, delta: str, done: bool) -> tuple[str, list[Piece]]:
        self.pending += delta
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        if done and self.pending.strip(_BETWEEN + "]"):
            content, self.pending = self.pending, ""  # cut short before a call's head was whole
            return content, pieces
        return "", pieces

    def _step(self, pieces: list[Piece]) -> bool:
        """Show what the pending text settles; whether to look again."""
        if not self.opened:
            start = _skip(self.pending, 0, _WHITESPACE)
            if not self.pending.startswith("[", start):
                return False
            self.opened, self.pending = True, self.pending[start + 1 :]
        if self.arguments is not None:
            return self._stream_arguments(self.arguments, pieces)
        start = _skip(self.pending, 0, _BETWEEN)
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            self.pending = ""  # parallel_tool_calls=false: the rest is not shown
            return False
        head = _HEAD.match(self.pending, start)
        if head is not None and (name := json.loads(head.group(1))) in self.parser.tool_names:
            pieces.append((self.num_calls, name, ""))
            self.pending, self.arguments = self.pending[head.end() :], _ObjectEnd()
            return True
        return self._whole_call(start, pieces)

    def _stream_arguments(self, arguments: _ObjectEnd, pieces: list[Piece]) -> bool:
        end = arguments.scan(self.pending)
        shown = self.pending if end is None else self.pending[:end]
        if shown:
            pieces.append((self.num_calls, None, shown))
        self.pending = "" if end is None else self.pending[end:]
        if end is None:
            return False
        self.arguments = None
        self.num_calls += 1
        return True

    def _whole_call(self, start: int, pieces: list[Piece]) -> bool:
        # Keys in another order: the call is shown once it is complete.
        decoded = decode_json_at(self.pending, start)
        call = None if decoded is None else self.parser.call_from(decoded[0], ("parameters",))
        if decoded is None or call is None:
            return False
        pieces += [(self.num_calls, call.name, ""), (self.num_calls, None, call.arguments)]
        self.pending, self.num_calls = self.pending[decoded[1] :], self.num_calls + 1
        return True


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
