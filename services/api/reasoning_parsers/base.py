"""The interface of a reasoning parser: model text in, (reasoning, content) out.

One instance reads one reply. ``feed(delta, final)`` takes the next piece
of the reply's text, in pieces of any size (one character, or the whole
reply with ``final``), and returns the reasoning and the content that piece
settles; text that may be the start of a tag is held back until what
follows (or the end) settles it. A whole reply is one ``feed(text, True)``
on a fresh parser, so the streamed split and the whole one agree by
construction.
"""

from __future__ import annotations

import abc
from typing import ClassVar


class ReasoningParser(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """The (reasoning, content) text that ``delta`` settles; with ``final``
        the reply is complete and every held character is settled."""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply's reasoning and content, each None when empty."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None
