"""Reasoning parsers, picked by ``--reasoning-parser NAME``: the thinking a
model writes between ``<think>`` and ``</think>`` goes to ``reasoning_content``
(chat) or a ``reasoning`` item (Responses), the rest is the reply."""

from __future__ import annotations

from services.api.reasoning_parsers.base import ReasoningParser
from services.api.reasoning_parsers.think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}."
        ) from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "reasoning_parser_class"]
