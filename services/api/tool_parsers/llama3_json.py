"""Llama 3.x JSON tool calls: the whole reply is ``{"name": ..., "parameters": {...}}``,
optionally after ``<|python_tag|>``, several joined by ``;``.

A reply that starts otherwise is plain content. Text that is not a call
(a JSON object naming no offered tool, words after the calls) stays content.
"""

from __future__ import annotations

from services.api.tool_parsers.base import Segment, ToolParser, decode_json_at

BOT = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.in_calls = False  # the reply's start was read: it is calls, and what follows goes on with them
        self.held = 0  # how much of the next text was held back as an unfinished object

    def split(self, text: str, final: bool) -> tuple[list[Segment], int]:
        if self.in_calls:
            if not final and "}" not in text[self.held :]:
                return [], 0  # nothing new can end the object: spare decoding it again
            return self._calls(text, 0, final)
        pos = len(text) - len(text.lstrip())
        rest = text[pos:]
        if not final and (not rest or BOT.startswith(rest)):
            return [], 0  # too early to tell
        if rest.startswith(BOT):
            pos += len(BOT)
        elif not rest.startswith("{"):
            return [text], len(text)
        self.in_calls = True
        return self._calls(text, pos, final)

    def _calls(self, text: str, pos: int, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        self.held = 0
        while True:
            pos = _skip_separators(text, pos)
            if pos == len(text):
                return segments, pos
            decoded = decode_json_at(text, pos)
            call = None if decoded is None else self.call_from(decoded[0])
            if decoded is not None and call is None:  # complete JSON, but not a call: content
                segments.append(text[pos : decoded[1]])
                pos = decoded[1]
                continue
            if decoded is None or call is None:
                if not final:
                    self.held = len(text) - pos
                    return segments, pos  # an object still being written, perhaps
                segments.append(text[pos:])
                return segments, len(text)
            segments.append(call)
            pos = decoded[1]


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos
