"""Mistral tool calls: ``[TOOL_CALLS]`` then the calls, in either of Mistral's two forms.

Older templates (tokenizer v3) write one JSON array of
``{"name": ..., "arguments": {...}}`` after ``[TOOL_CALLS]``; newer ones
(v11 on) write ``[TOOL_CALLS]name[ARGS]{...}`` per call, several in a row.
Text before the first ``[TOOL_CALLS]`` (and any that is not a call) is
content. ``[TOOL_CALLS]`` is a special token, so the reply keeps special
tokens while this parser reads it. Mistral's templates refuse call ids that
are not 9 letters and digits, so the calls get such ids.
"""

from __future__ import annotations

import enum
import random
import re
import string
from typing import Literal

from services.api.tool_parsers.base import (
    ParsedCall,
    Segment,
    ToolParser,
    all_calls,
    decode_json_at,
    partial_prefix_length,
)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits
# What may stand between [TOOL_CALLS] and [ARGS]: a function name (OpenAI allows these characters).
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]{1,256})\s*")
_SPACE = re.compile(r"\s*")


class _Decoded(enum.Enum):
    NOT_JSON = enum.auto()  # the text is complete, and what starts at the position is not JSON


_JsonAt = tuple[object, int] | Literal[_Decoded.NOT_JSON] | None


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.held = 0  # how much of the next text was held back as an unfinished JSON value

    @staticmethod
    def new_call_id() -> str:
        return "".join(random.choices(_ID_ALPHABET, k=9))

    def split(self, text: str, final: bool) -> tuple[list[Segment], int]:
        if self.held and not final and not any(c in text[self.held :] for c in "}]"):
            return [], 0  # nothing new can end the held JSON value: spare decoding it again
        self.held = 0
        segments: list[Segment] = []
        pos = 0
        while True:
            start = text.find(BOT, pos)
            if start < 0:
                end = len(text) if final else len(text) - partial_prefix_length(text[pos:], BOT)
                segments.append(text[pos:end])
                return segments, end
            segments.append(text[pos:start])
            found = self._calls_at(text, start + len(BOT), final)
            if found is None:  # still being written
                return segments, start
            calls, end = found
            # Not a call: the marker is content, and so is what follows it up to the next one.
            segments += calls or [text[start:end]]
            pos = end

    def _calls_at(self, text: str, pos: int, final: bool) -> tuple[list[ParsedCall], int] | None:
        """The calls written from ``pos`` (just after [TOOL_CALLS]) and where they end,
        None while more text may yet make them calls. No calls: the end is where
        content goes on (after a complete JSON value that is not a call, else
        after the marker), so a stream and the whole text agree."""
        start = _space_end(text, pos)
        if start == len(text):
            return ([], pos) if final else None
        if text[start] == "[":
            decoded = self._json_at(text, start, final)
            if decoded is None or decoded is _Decoded.NOT_JSON:
                return None if decoded is None else ([], pos)
            value, end = decoded
            calls = all_calls([self.call_from(item) for item in value]) if isinstance(value, list) else None
            return (calls, end) if calls else ([], end)
        args = text.find(ARGS, start)
        if args < 0:
            # A name still being written (perhaps with "[ARGS]" half-way in) may yet make a call.
            cut = len(text) - partial_prefix_length(text[start:], ARGS)
            waiting = not final and _NAME.fullmatch(text, start, cut) is not None
            return None if waiting else ([], pos)
        name = _NAME.fullmatch(text, start, args)
        value_at = _space_end(text, args + len(ARGS))
        if name is None or value_at < len(text) and text[value_at] != "{":
            return [], pos
        decoded = self._json_at(text, value_at, final)
        if decoded is None or decoded is _Decoded.NOT_JSON:
            return None if decoded is None else ([], pos)
        call = self.call_from({"name": name.group(1), "arguments": decoded[0]})
        return ([call] if call else []), decoded[1]

    def _json_at(self, text: str, pos: int, final: bool) -> _JsonAt:
        """The JSON value at ``pos`` and its end; None (held) while it may still
        be written, _NOT_JSON once the text is complete and it is not."""
        decoded = decode_json_at(text, pos)
        if decoded is not None:
            return decoded
        if final:
            return _Decoded.NOT_JSON
        self.held = len(text) - text.rfind(BOT, 0, pos)
        return None


def _space_end(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)
    assert match is not None  # \s* matches everywhere
    return match.end()
