"""Tool calling on chat completions: what ``tool_choice`` asks, and the calls in the output.

``none``: plain text (the tools still reach the template). ``auto``: the
model decides, and the server's ``--tool-call-parser`` finds the calls in
its text. ``required`` and a named function: structured outputs force the
text to be calls, so they always parse (a JSON array of
``{"name", "parameters"}`` objects, or the named function's arguments), as
vLLM does. ``ToolOutput`` turns one choice's text into content and calls,
streamed as OpenAI's tool-call deltas or whole. Forced calls stream their
arguments as they are written; ``auto`` shows a call once it is complete,
so a malformed one is never half-shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from protocol import StructuredOutputsParams
from services.api.errors import bad_request
from services.api.openai_schemas import (
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from services.api.required_tool_calls import RequiredCallsParser, RequiredCallsStream
from services.api.tool_parsers import ParsedCall, Segment, ToolParser

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice`` resolved: ``kind`` is none, auto, required or named (then ``name``)."""

    kind: str
    tools: tuple[ChatTool, ...] = ()
    name: str | None = None
    parallel: bool = True

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools)


def resolve_tool_choice(body: ChatCompletionRequest, auto_parser: type[ToolParser] | None) -> ToolChoice:
    """What the request asks of tools; 400 naming the field when it cannot be done."""
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's and vLLM's default
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools: give the functions the model may call.", "tool_choice")
    _check_unique_names(tools)
    if choice == "auto" and auto_parser is None:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set on the server.",
            "tool_choice",
        )
    if isinstance(choice, str):
        return ToolChoice(choice, tools, parallel=body.parallel_tool_calls)
    name = choice.function.name
    if name not in {t.function.name for t in tools}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools.", "tool_choice")
    return ToolChoice("named", tools, name, parallel=body.parallel_tool_calls)


def _check_unique_names(tools: tuple[ChatTool, ...]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise bad_request(f"Two tools are named {tool.function.name!r}.", f"tools[{i}].function.name")
        seen.add(tool.function.name)


def tool_dicts(tools: list[ChatTool] | None) -> list[dict] | None:
    """The tools as the chat template sees them (transformers passes the JSON as sent)."""
    return None if not tools else [_to_dict(t) for t in tools]


def _to_dict(tool: ChatTool) -> dict:
    function = {"name": tool.function.name}
    for key in ("description", "parameters", "strict"):
        value = getattr(tool.function, key)
        if value is not None:
            function[key] = value
    return {"type": tool.type, "function": function}


def constraint_for(choice: ToolChoice) -> StructuredOutputsParams | None:
    """The JSON schema that forces a required or named choice's output to be calls."""
    if choice.kind == "named":
        tool = next(t for t in choice.tools if t.function.name == choice.name)
        return StructuredOutputsParams(json=tool.function.parameters or _EMPTY_PARAMETERS)
    if choice.kind == "required":
        return StructuredOutputsParams(json=required_schema(choice.tools, choice.parallel))
    return None


def required_schema(tools: tuple[ChatTool, ...], parallel: bool = True) -> dict:
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
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


new_tool_call_id = ToolParser.new_call_id


class ToolOutput:
    """One choice's text as content and calls: ``feed`` for a stream, ``complete`` for a whole reply."""

    def __init__(self, choice: ToolChoice, auto_parser: type[ToolParser] | None) -> None:
        self.choice = choice
        self.num_calls = 0  # calls shown so far
        # How a whole reply is read (None: it is all content, or for "named" all arguments).
        self.parser_class = {"auto": auto_parser, "required": RequiredCallsParser}.get(choice.kind)
        self.auto_parser = auto_parser(choice.tool_names) if choice.kind == "auto" else None
        self.required_stream = (
            RequiredCallsStream(choice.tool_names, None if choice.parallel else 1)
            if choice.kind == "required"
            else None
        )
        # Ids in the shape the server's model family wants (Mistral's templates check theirs).
        self.new_id = auto_parser.new_call_id if auto_parser is not None else new_tool_call_id
        self.named_id = self.new_id() if choice.kind == "named" else None
        self.buffer = ""  # streamed text the auto parser has not settled yet

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def complete(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None when there is none) and the calls of a whole reply."""
        if self.choice.kind == "named":
            self.num_calls = 1
            return None, [ToolCall(id=self.named_id, function=FunctionCall(self.choice.name, text))]
        if self.parser_class is None:
            return text, []
        segments, _ = self.parser_class(self.choice.tool_names).split(text, final=True)
        calls = [
            ToolCall(id=self.new_id(), function=FunctionCall(s.name, s.arguments))
            for s in self._allowed_calls(segments)
        ]
        self.num_calls = len(calls)
        content = "".join(s for s in segments if isinstance(s, str))
        return (content if content.strip() or not calls else None), calls

    def feed(self, delta: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and tool-call deltas that ``delta`` (the next streamed text) settles."""
        if self.choice.kind == "named":
            return "", self._named_delta(delta)
        if self.required_stream is not None:
            return self._required_deltas(delta, done)
        if self.auto_parser is None:
            return delta, []
        self.buffer += delta
        segments, settled = self.auto_parser.split(self.buffer, final=done)
        self.buffer = self.buffer[settled:]
        content = "".join(s for s in segments if isinstance(s, str))
        deltas = []
        for call in self._allowed_calls(segments):
            deltas += self._call_deltas(call)
        return content, deltas

    def _allowed_calls(self, segments: list[Segment]) -> list[ParsedCall]:
        calls = [s for s in segments if isinstance(s, ParsedCall)]
        if not self.choice.parallel:
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

    def _required_deltas(self, delta: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        content, pieces = self.required_stream.feed(delta, done)
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

    def _named_delta(self, delta: str) -> list[DeltaToolCall]:
        if not self.num_calls:
            self.num_calls = 1
            return [
                DeltaToolCall(
                    index=0,
                    id=self.named_id,
                    type="function",
                    function=DeltaFunctionCall(name=self.choice.name, arguments=delta),
                )
            ]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))] if delta else []


def history_tool_calls(calls) -> list[dict]:
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
