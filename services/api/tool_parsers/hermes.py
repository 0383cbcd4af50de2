"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Any number of call blocks, with text around them; the text is the reply's content.
"""

from __future__ import annotations

from services.api.tool_parsers.base import (
    ParsedCall,
    Segment,
    ToolParser,
    decode_json_at,
    partial_prefix_length,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def split(self, text: str, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                # Text that may be the beginning of a tag waits for what follows.
                end = len(text) if final else len(text) - partial_prefix_length(text[pos:], START)
                segments.append(text[pos:end])
                return segments, end
            segments.append(text[pos:start])
            stop = text.find(END, start)
            if stop < 0:  # the call is still being written, or never closed
                if final:
                    segments.append(text[start:])
                    return segments, len(text)
                return segments, start
            segments.append(self._call(text[start + len(START) : stop]) or text[start : stop + len(END)])
            pos = stop + len(END)

    def _call(self, body: str) -> ParsedCall | None:
        body = body.strip()
        decoded = decode_json_at(body, 0)
        if decoded is None or decoded[1] != len(body):
            return None
        return self.call_from(decoded[0])
