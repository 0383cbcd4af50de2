"""The chat completions' server options: the chat template, tool calling and reasoning."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.api.chat_template import check_template, load_chat_template
from services.api.reasoning_parsers import REASONING_PARSERS, ReasoningParser, reasoning_parser_class
from services.api.tool_parsers import TOOL_PARSERS, ToolParser, tool_parser_class


@dataclass(frozen=True)
class ChatSettings:
    chat_template: str | None = None
    """The template's text, instead of the model's own (None: the model's)."""
    trust_request_chat_template: bool = False
    """Whether a request's own ``chat_template`` may run (it is code, whose cost the client picks)."""
    enable_auto_tool_choice: bool = False
    """Whether ``tool_choice: "auto"`` is served (it needs ``tool_call_parser``)."""
    tool_call_parser: str | None = None
    """The name of the parser that finds tool calls in the model's text."""
    reasoning_parser: str | None = None
    """The name of the parser that splits the model's thinking from its reply (None: no split)."""

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser to name the model's "
                f"tool-call format ({', '.join(sorted(TOOL_PARSERS))})."
            )
        if self.tool_call_parser is not None:
            tool_parser_class(self.tool_call_parser)  # ValueError for an unknown name
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)  # ValueError for an unknown name
        if self.chat_template is not None:
            check_template(self.chat_template)

    @property
    def auto_parser(self) -> type[ToolParser] | None:
        """The parser class for ``auto``, or None when auto is not served."""
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:  # auto needs a parser
            return None
        return tool_parser_class(self.tool_call_parser)

    @property
    def reasoning_parser_class(self) -> type[ReasoningParser] | None:
        return None if self.reasoning_parser is None else reasoning_parser_class(self.reasoning_parser)


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chat template and tool calling")
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE-OR-TEMPLATE",
        help="A Jinja chat template, as a file or inline, instead of the model's own.",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Let requests bring their own chat_template (refused with 400 otherwise).",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Serve tool_choice "auto": the model decides, --tool-call-parser finds calls.',
    )
    group.add_argument(
        "--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS), help="The model's tool-call format."
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="Split the model's <think>...</think> text into reasoning_content (chat) and "
        "reasoning items (Responses) (default: none, all text is content).",
    )


def chat_settings_from(args: argparse.Namespace) -> ChatSettings:
    """ValueError when the options do not fit together or the template does not load."""
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    return ChatSettings(
        chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
