"""A Responses reply's output items, built from its text as it streams in.

``ResponseOutput.feed`` takes the next piece of the reply's text; the
reasoning parser (if any) splits the thinking off, the chat path's
``ToolOutput`` finds the calls, and what is left is the message. Each
becomes an output item in the order it starts (reasoning, message,
function calls), the open item closing when another starts. Every change
is also an SSE event in OpenAI's shape, encoded when it happens (items
change later) and numbered in order. A whole reply is one ``feed`` with
``done``: the same items, the events unread.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from services.api.openai_schemas import DeltaToolCall
from services.api.reasoning_parsers import ReasoningParser
from services.api.responses_schemas import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
)
from services.api.tool_calling import ToolOutput


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict[str, Any]) -> bytes:
    """One SSE event as OpenAI sends them: its type named on the ``event:`` line too."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class EventLog:
    """Events in the order they happen, each numbered and encoded at once."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off for a whole reply: nobody reads its events
        self.sequence_number = 0
        self.pending: list[bytes] = []

    def emit(self, type: str, **fields: Any) -> None:
        if not self.enabled:
            return
        self.pending.append(sse_event({"type": type, "sequence_number": self.sequence_number, **fields}))
        self.sequence_number += 1

    def take(self) -> list[bytes]:
        events, self.pending = self.pending, []
        return events


class ResponseOutput:
    def __init__(
        self, events: EventLog, tools: ToolOutput | None = None, reasoning: ReasoningParser | None = None
    ) -> None:
        self.events = events
        self.tools, self.reasoning = tools, reasoning
        self.items: list[OutputItem] = []
        self.reasoning_text = ""  # all of it, for usage
        self._open: OutputItem | None = None
        self._space = ""  # whitespace a message has not opened for yet (dropped if none does)
        self._calls: dict[int, FunctionCallItem] = {}  # ToolOutput's call index -> its item

    def feed(self, text: str, done: bool) -> None:
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, done)
            if thought:
                self._add_reasoning(thought)
        deltas: list[DeltaToolCall] = []
        if self.tools is not None:
            text, deltas = self.tools.feed(text, done)
        if text:
            self._add_content(text)
        for delta in deltas:
            self._add_call(delta)

    def finish(self, status: str) -> None:
        """Close the item still open: ``status`` is the reply's (incomplete when it was cut)."""
        if self._open is not None:
            self._close(self._open, "incomplete" if status == "incomplete" else "completed")

    def _index(self, item: OutputItem) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _start(self, item: OutputItem, part: OutputText | ReasoningText | None = None) -> None:
        if self._open is not None:
            self._close(self._open, "completed")
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        self.events.emit("response.output_item.added", output_index=index, item=item)
        if part is not None:
            self.events.emit(
                "response.content_part.added", item_id=item.id, output_index=index, content_index=0, part=part
            )
        # The snapshots above are encoded; the item grows from here.
        if isinstance(item, MessageItem) and isinstance(part, OutputText):
            item.content = [msgspec.structs.replace(part)]
        elif isinstance(item, ReasoningItem) and isinstance(part, ReasoningText):
            item.content = [msgspec.structs.replace(part)]

    def _add_reasoning(self, text: str) -> None:
        self.reasoning_text += text
        item = self._open
        if not isinstance(item, ReasoningItem):
            item = ReasoningItem(id=new_item_id("rs"), content=[], status="in_progress")
            self._start(item, ReasoningText(text=""))
        self._grow(item, text, "response.reasoning_text.delta")

    def _add_content(self, text: str) -> None:
        item = self._open
        if not isinstance(item, MessageItem):
            if not text.strip():
                self._space += text
                return
            text, self._space = self._space + text, ""
            item = MessageItem(id=new_item_id("msg"), content=[], status="in_progress")
            self._start(item, OutputText(text=""))
        self._grow(item, text, "response.output_text.delta", logprobs=[])

    def _grow(self, item: MessageItem | ReasoningItem, text: str, event: str, **extra: Any) -> None:
        """Add ``text`` to the open item's one part and emit it as a delta ``event``."""
        item.content[0].text += text
        self.events.emit(
            event, item_id=item.id, output_index=self._index(item), content_index=0, delta=text, **extra
        )

    def _add_call(self, delta: DeltaToolCall) -> None:
        function = delta.function
        arguments = (function.arguments if function is not None else None) or ""
        if delta.id is not None:  # a call's first delta names it
            assert function is not None and function.name is not None, "a call's first delta has its name"
            item = FunctionCallItem(
                id=new_item_id("fc"), call_id=delta.id, name=function.name, arguments="", status="in_progress"
            )
            self._calls[delta.index] = item
            self._start(item)
        item = self._calls[delta.index]
        if arguments:
            item.arguments += arguments
            self.events.emit(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=self._index(item),
                delta=arguments,
            )

    def _close(self, item: OutputItem, status: str) -> None:
        index = self._index(item)
        item.status = status
        self._open = None
        if isinstance(item, FunctionCallItem):
            self.events.emit(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            )
        else:
            part = item.content[0]
            kind = "output_text" if isinstance(item, MessageItem) else "reasoning_text"
            extra: dict[str, list[object]] = {"logprobs": []} if kind == "output_text" else {}
            self.events.emit(
                f"response.{kind}.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
                **extra,
            )
            self.events.emit(
                "response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part
            )
        self.events.emit("response.output_item.done", output_index=index, item=item)
