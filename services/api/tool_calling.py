"""Tool calling on chat completions: what ``tool_choice`` asks, and the calls in the output.

``resolve_tool_choice`` turns the request's ``tool_choice`` into one of four
strategies, and the chat path asks the strategy, never the string:

- ``NoTools`` (``none``, or no tools): plain text (the tools still reach the template).
- ``AutoCalls`` (``auto``): the model decides, and the server's ``--tool-call-parser``
  finds the calls in its text; a call shows once it is complete, so a malformed one
  is never half-shown.
- ``RequiredCalls`` (``required``): structured outputs force a JSON array of
  ``{"name", "parameters"}`` objects, as vLLM does, so the text always parses.
- ``NamedCall`` (a named function): structured outputs force the function's arguments.

Each strategy has its ``constraint`` (the structured-output schema that forces
calls, or None), ``sampling`` (the request's SamplingParams with what it needs),
and ``output``: a fresh ``ToolOutput`` for one choice, whose ``feed`` turns
streamed text into content and OpenAI's tool-call deltas and whose ``complete``
reads a whole reply. Forced calls stream their arguments as they are written.

A request that forces calls and also asks for structured output through
another field is refused by ``resolve_tool_choice``, before either
constraint is built or checked: only the fields' presence is looked at.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol import SamplingParams, StructuredOutputsParams
from services.api.errors import APIError, bad_request
from services.api.openai_schemas import (
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from services.api.required_tool_calls import RequiredCallsParser, RequiredCallsStream
from services.api.structured_outputs import check_constraint, requested_fields
from services.api.tool_parsers import ParsedCall, Segment, ToolParser

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

NewCallId = Callable[[], str]
new_tool_call_id: NewCallId = ToolParser.new_call_id


def _names(tools: tuple[ChatTool, ...]) -> frozenset[str]:
    return frozenset(t.function.name for t in tools)


@dataclass(frozen=True)
class NoTools:
    """``tool_choice: "none"`` (or no tools): the reply is text."""

    def constraint(self) -> StructuredOutputsParams | None:
        return None

    def sampling(self, params: SamplingParams) -> SamplingParams:
        return params

    def output(self) -> ToolOutput:
        return PlainOutput()


@dataclass(frozen=True)
class AutoCalls:
    """``tool_choice: "auto"``: the model decides; ``parser`` finds the calls in its text."""

    tools: tuple[ChatTool, ...]
    parser: type[ToolParser]
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        return None

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """A parser whose call markers are special tokens must see them in the text (as vLLM's
        mistral parser turns skip_special_tokens off)."""
        if not self.parser.keeps_special_tokens:
            return params
        return msgspec.structs.replace(params, skip_special_tokens=False)

    def output(self) -> ToolOutput:
        return ParsedOutput(self.parser, _names(self.tools), self.parallel, self.parser.new_call_id)


@dataclass(frozen=True)
class RequiredCalls:
    """``tool_choice: "required"``: a JSON schema forces an array of calls."""

    tools: tuple[ChatTool, ...]
    parallel: bool = True
    new_id: NewCallId = new_tool_call_id  # the server's model family's shape of call ids

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))

    def sampling(self, params: SamplingParams) -> SamplingParams:
        return _forced(params, self.constraint())

    def output(self) -> ToolOutput:
        return RequiredOutput(_names(self.tools), self.parallel, self.new_id)


@dataclass(frozen=True)
class NamedCall:
    """``tool_choice`` naming a function: its parameters' schema forces the whole reply."""

    tool: ChatTool
    new_id: NewCallId = new_tool_call_id

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.tool.function.parameters or _EMPTY_PARAMETERS)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        return _forced(params, self.constraint())

    def output(self) -> ToolOutput:
        return NamedOutput(self.tool.function.name, self.new_id())


ToolStrategy = NoTools | AutoCalls | RequiredCalls | NamedCall


def resolve_tool_choice(body: ChatCompletionRequest, auto_parser: type[ToolParser] | None) -> ToolStrategy:
    """What the request asks of tools; 400 naming the field when it cannot be done.

    Only looks at the request's fields: no schema is built or checked here."""
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's and vLLM's default
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools: give the functions the model may call.", "tool_choice")
    _check_unique_names(tools)
    if choice == "none":
        return NoTools()
    if choice == "auto":
        if auto_parser is None:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set on the server.",
                "tool_choice",
            )
        return AutoCalls(tools, auto_parser, body.parallel_tool_calls)
    # Ids in the shape the server's model family wants (Mistral's templates check theirs).
    new_id = auto_parser.new_call_id if auto_parser is not None else new_tool_call_id
    strategy: ToolStrategy
    if choice == "required":
        strategy = RequiredCalls(tools, body.parallel_tool_calls, new_id)
    else:
        strategy = NamedCall(_named_tool(tools, choice.function.name), new_id)
    _refuse_second_constraint(body)
    return strategy


def _named_tool(tools: tuple[ChatTool, ...], name: str) -> ChatTool:
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools.", "tool_choice")
    return tool


def _check_unique_names(tools: tuple[ChatTool, ...]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise bad_request(f"Two tools are named {tool.function.name!r}.", f"tools[{i}].function.name")
        seen.add(tool.function.name)


def _refuse_second_constraint(body: ChatCompletionRequest) -> None:
    """Forced calls are the output's constraint: a request asking for another one is a 400,
    found from the fields alone (neither constraint is built or checked first)."""
    if requested_fields(body):
        raise _conflict()


def _conflict() -> APIError:
    return bad_request(
        "tool_choice required or a named function already constrains the output; "
        "drop the structured-output field.",
        "tool_choice",
    )


def _forced(params: SamplingParams, constraint: StructuredOutputsParams) -> SamplingParams:
    """``params`` bound by the forced calls' ``constraint``, after its syntax checks."""
    if params.structured_outputs is not None:
        raise _conflict()  # resolve_tool_choice refuses it first; never overwrite one silently
    try:
        check_constraint(constraint)
    except ValueError as e:
        raise bad_request(f"The tools' parameters do not make a usable JSON schema: {e}", "tools") from e
    return msgspec.structs.replace(params, structured_outputs=constraint)


def tool_dicts(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them (transformers passes the JSON as sent)."""
    return None if not tools else [_to_dict(t) for t in tools]


def _to_dict(tool: ChatTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    for key in ("description", "parameters", "strict"):
        value = getattr(tool.function, key)
        if value is not None:
            function[key] = value
    return {"type": tool.type, "function": function}


def required_schema(tools: tuple[ChatTool, ...], parallel: bool = True) -> dict[str, Any]:
    """An array of one or more ``{"name": N, "parameters": P}``, with P following N's schema.

    Each tool's ``$defs`` move to the root, where its ``#/$defs/...`` references
    still find them once the schema sits inside the array; two tools defining
    one name differently cannot share it (400)."""
    defs: dict[str, object] = {}
    options = []
    for i, tool in enumerate(tools):
        parameters = dict(tool.function.parameters or _EMPTY_PARAMETERS)
        for def_name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(def_name, definition) != definition:
                raise bad_request(
                    f"Tools define $defs.{def_name} differently; give each its own name.",
                    f"tools[{i}].function.parameters",
                )
        options.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class ToolOutput(abc.ABC):
    """One choice's text as content and calls: ``feed`` for a stream, ``complete`` for a whole reply."""

    def __init__(self) -> None:
        self.num_calls = 0  # calls shown so far

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    @abc.abstractmethod
    def feed(self, delta: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and tool-call deltas that ``delta`` (the next streamed text) settles."""

    @abc.abstractmethod
    def complete(self, text: str | None) -> tuple[str | None, list[ToolCall]]:
        """The content (None when there is none) and the calls of a whole reply."""


class PlainOutput(ToolOutput):
    """``NoTools``: all of it is content."""

    def feed(self, delta: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        return delta, []

    def complete(self, text: str | None) -> tuple[str | None, list[ToolCall]]:
        return text, []


class ParsedOutput(ToolOutput):
    """Calls a parser finds in the text (``AutoCalls``' parser, or the required array's)."""

    def __init__(
        self, parser: type[ToolParser], tool_names: frozenset[str], parallel: bool, new_id: NewCallId
    ) -> None:
        super().__init__()
        self.parser_class, self.tool_names = parser, tool_names
        self.parser = parser(tool_names)  # reads a stream
        self.parallel, self.new_id = parallel, new_id
        self.buffer = ""  # streamed text the parser has not settled yet

    def complete(self, text: str | None) -> tuple[str | None, list[ToolCall]]:
        # A parser of its own: one instance reads one reply.
        segments, _ = self.parser_class(self.tool_names).split(text or "", final=True)
        calls = [
            ToolCall(id=self.new_id(), function=FunctionCall(s.name, s.arguments))
            for s in self._allowed_calls(segments)
        ]
        self.num_calls = len(calls)
        content = "".join(s for s in segments if isinstance(s, str))
        return (content if content.strip() or not calls else None), calls

    def feed(self, delta: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += delta
        segments, settled = self.parser.split(self.buffer, final=done)
        self.buffer = self.buffer[settled:]
        content = "".join(s for s in segments if isinstance(s, str))
        deltas = []
        for call in self._allowed_calls(segments):
            deltas += self._call_deltas(call)
        return content, deltas

    def _allowed_calls(self, segments: list[Segment]) -> list[ParsedCall]:
        calls = [s for s in segments if isinstance(s, ParsedCall)]
        if not self.parallel:
            calls = calls[: max(0, 1 - self.num_calls)]  # parallel_tool_calls=false: the first call only
        return calls

    def _call_deltas(self, call: ParsedCall) -> list[DeltaToolCall]:
        # OpenAI's shape: the first delta of a call names it, the next ones add arguments.
        index = self.num_calls
        self.num_calls += 1
        return [
            DeltaToolCall(
                index=index,
                id=self.new_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=""),
            ),
            DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments)),
        ]


class RequiredOutput(ParsedOutput):
    """``RequiredCalls``: the forced array, each call's arguments streamed as they are written."""

    def __init__(self, tool_names: frozenset[str], parallel: bool, new_id: NewCallId) -> None:
        super().__init__(RequiredCallsParser, tool_names, parallel, new_id)
        self.stream = RequiredCallsStream(tool_names, None if parallel else 1)

    def feed(self, delta: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        content, pieces = self.stream.feed(delta, done)
        deltas = []
        for index, name, arguments in pieces:
            if name is not None:
                self.num_calls += 1
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=self.new_id(),
                        type="function",
                        function=DeltaFunctionCall(name=name, arguments=""),
                    )
                )
            elif arguments:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments)))
        return content, deltas


class NamedOutput(ToolOutput):
    """``NamedCall``: the whole reply is one call's arguments."""

    def __init__(self, name: str, call_id: str) -> None:
        super().__init__()
        self.name, self.call_id = name, call_id

    def complete(self, text: str | None) -> tuple[str | None, list[ToolCall]]:
        self.num_calls = 1
        return None, [ToolCall(id=self.call_id, function=FunctionCall(self.name, text or ""))]

    def feed(self, delta: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        if not self.num_calls:
            self.num_calls = 1
            head = DeltaFunctionCall(name=self.name, arguments=delta)
            return "", [DeltaToolCall(index=0, id=self.call_id, type="function", function=head)]
        return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))] if delta else []


def history_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's earlier calls as templates expect them: arguments
    as a dict (Llama's and Qwen's templates write them with ``tojson``)."""
    return [
        {
            "id": c.id,
            "type": c.type,
            "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
        }
        for c in calls
    ]


def _arguments(text: str) -> object:
    try:
        value = json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets the text as the client sent it
    return value if isinstance(value, dict) else text
