"""Tool-call parsers for ``tool_choice: "auto"``, picked by ``--tool-call-parser NAME``."""

from __future__ import annotations

from services.api.tool_parsers.base import ParsedCall, Segment, ToolParser
from services.api.tool_parsers.hermes import HermesToolParser
from services.api.tool_parsers.llama3_json import Llama3JsonToolParser
from services.api.tool_parsers.mistral import MistralToolParser
from services.api.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"Unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}."
        ) from None


__all__ = ["TOOL_PARSERS", "ParsedCall", "Segment", "ToolParser", "tool_parser_class"]
