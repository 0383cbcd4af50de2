"""``<think>...</think>`` reasoning: DeepSeek R1's and Qwen3's.

- ``deepseek_r1``: everything before ``</think>`` is reasoning, with or
  without an opening ``<think>`` (R1's template writes that tag into the
  prompt); a reply that never closes the tag is all reasoning (vLLM's rule).
- ``qwen3``: the reply must open with ``<think>`` (after whitespace) for
  anything to be reasoning; without it the whole reply is content. An
  opened tag the reply never closes (cut by ``max_tokens``) leaves the rest
  as reasoning, streamed or whole.

After ``</think>`` everything is content, as written.
"""

from __future__ import annotations

from services.api.reasoning_parsers.base import ReasoningParser
from services.api.tool_parsers.base import partial_prefix_length

START, END = "<think>", "</think>"


class _ThinkTagParser(ReasoningParser):
    # Whether text before ``</think>`` is reasoning even when the reply did not open the tag.
    implicit_start: bool

    def __init__(self) -> None:
        self.state = "start"  # start (nothing decided yet), reasoning, content
        self.held = ""  # text not settled yet: a tag may be starting

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        text = self.held + delta
        self.held = ""
        reasoning = content = ""
        if self.state == "start":
            text = self._opening(text, final)
            if self.state == "start":
                return "", ""
        if self.state == "reasoning":
            reasoning, text = self._reasoning(text, final)
        if self.state == "content":
            content = text
        return reasoning, content

    def _opening(self, text: str, final: bool) -> str:
        """Decide how the reply starts; returns the text left to split."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            self.state = "reasoning"
            return stripped[len(START) :]
        if not final and START.startswith(stripped):
            self.held = text  # empty so far, or the start of ``<think>``
            return ""
        self.state = "reasoning" if self.implicit_start else "content"
        return text

    def _reasoning(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning in ``text``, and what follows ``</think>`` (the state moves on then)."""
        end = text.find(END)
        if end >= 0:
            self.state = "content"
            return text[:end], text[end + len(END) :]
        keep = 0 if final else partial_prefix_length(text, END)
        if keep:
            self.held = text[-keep:]
            text = text[:-keep]
        return text, ""


class DeepSeekR1ReasoningParser(_ThinkTagParser):
    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(_ThinkTagParser):
    name = "qwen3"
    implicit_start = False
