"""Server-wide choices about what the OpenAI API accepts and reports (``weft serve`` flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class APIOptions:
    allow_unknown_fields: bool = False
    """Log a warning for request fields weft does not know, instead of a 400."""
    enable_force_include_usage: bool = False
    """Every stream ends with a usage chunk, whatever stream_options says (vLLM's flag)."""


def add_api_option_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI API behaviour")
    group.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="Accept request fields weft does not know, with a logged warning (default: a 400 naming them).",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="Send a usage chunk at the end of every stream, even without stream_options.include_usage.",
    )


def api_options(args: argparse.Namespace) -> APIOptions:
    return APIOptions(
        allow_unknown_fields=args.allow_unknown_fields,
        enable_force_include_usage=args.enable_force_include_usage,
    )
