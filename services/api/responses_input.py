"""A Responses request as the chat path's request: its items as chat messages, its options as chat fields.

Messages keep their role (``developer`` speaks as ``system``: chat templates
know no other), ``function_call`` items become an assistant's tool calls,
``function_call_output`` items tool messages, and ``reasoning`` items the
following assistant turn's ``reasoning_content``. Everything else the
request asks (tools, tool_choice, text.format, sampling) is handed to the
chat request's own fields, so the chat path's checks and machinery serve
both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeGuard

from services.api.errors import bad_request
from services.api.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    ToolChoice,
)
from services.api.responses_schemas import (
    ContentPart,
    FunctionCallItem,
    InputItem,
    MessageItem,
    OutputItem,
    ResponsesRequest,
)

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "reasoning_text", "summary_text"})


def input_items(body: ResponsesRequest) -> list[InputItem]:
    """``input`` as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [InputItem(role="user", content=body.input)] if body.input else []
    return list(body.input)


def item_texts(items: list[InputItem]) -> Iterator[str]:
    """Every piece of text the items hold (for the size limit)."""
    for item in items:
        for value in (item.content, item.output, item.summary, item.arguments):
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):
                yield from (part.text for part in value if part.text is not None)


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[ChatMessage]:
    """The conversation as chat messages; 400 naming ``input[i]`` for an item that cannot be one."""
    messages = [] if instructions is None else [ChatMessage("system", instructions)]
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if item.type == "message":
            _add_message(messages, item, param)
        elif item.type == "function_call":
            _add_call(messages, item, param)
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise bad_request("A function_call_output item needs call_id and output.", param)
            messages.append(
                ChatMessage("tool", _text(item.output, f"{param}.output"), tool_call_id=item.call_id)
            )
        else:  # reasoning: the next assistant turn's thinking
            text = _text(item.content or [], f"{param}.content") or _text(
                item.summary or [], f"{param}.summary"
            )
            messages.append(ChatMessage("assistant", None, reasoning_content=text))
    if not messages:
        raise bad_request("input must hold at least one item (or instructions).", "input")
    return messages


def _add_message(messages: list[ChatMessage], item: InputItem, param: str) -> None:
    if item.role is None:
        raise bad_request("A message item needs a role.", f"{param}.role")
    text = _text(item.content if item.content is not None else "", f"{param}.content")
    role = "system" if item.role == "developer" else item.role
    last = messages[-1] if messages else None
    if role == "assistant" and _open_assistant(last) and not last.tool_calls:
        last.content = text  # the reply after its reasoning item
        return
    messages.append(ChatMessage(role, text))


def _add_call(messages: list[ChatMessage], item: InputItem, param: str) -> None:
    if item.call_id is None or item.name is None or item.arguments is None:
        raise bad_request("A function_call item needs call_id, name and arguments.", param)
    call = ToolCall(id=item.call_id, function=FunctionCall(item.name, item.arguments))
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), call]  # calls of one turn go together
    else:
        messages.append(ChatMessage("assistant", None, tool_calls=[call]))


def _open_assistant(message: ChatMessage | None) -> TypeGuard[ChatMessage]:
    """An assistant turn holding only thinking so far."""
    return message is not None and message.role == "assistant" and not message.content


def _text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise bad_request(f"Only text content parts are supported, got {part.type!r}.", f"{param}[{j}]")
        texts.append(part.text)
    return "".join(texts)


def output_as_input(items: list[OutputItem]) -> list[InputItem]:
    """A response's output items as input items, for the conversation the store keeps."""
    converted: list[InputItem] = []
    for item in items:
        if isinstance(item, MessageItem):
            parts = [ContentPart(type="output_text", text=p.text) for p in item.content]
            converted.append(InputItem(role="assistant", content=parts, id=item.id))
        elif isinstance(item, FunctionCallItem):
            converted.append(
                InputItem(
                    type="function_call",
                    call_id=item.call_id,
                    name=item.name,
                    arguments=item.arguments,
                    id=item.id,
                )
            )
        else:
            parts = [ContentPart(type="reasoning_text", text=p.text) for p in item.content]
            converted.append(InputItem(type="reasoning", content=parts, summary=[], id=item.id))
    return converted


def chat_request(body: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that asks what ``body`` asks (400 naming a field it cannot pass on)."""
    return ChatCompletionRequest(
        messages=messages,
        model=body.model,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=_tools(body),
        tool_choice=_tool_choice(body),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body),
        user=body.user,
        stream=body.stream,
        reasoning_effort=None if body.reasoning is None else body.reasoning.effort,
    )


def _tools(body: ResponsesRequest) -> list[ChatTool] | None:
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.type != "function":
            raise bad_request(f"Only function tools are supported, got {tool.type!r}.", f"tools[{i}].type")
        if tool.name is None:
            raise bad_request("A function tool needs a name.", f"tools[{i}].name")
        function = FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
        )
        tools.append(ChatTool(function=function))
    return tools


def _tool_choice(body: ResponsesRequest) -> ToolChoice | None:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}.',
            "tool_choice",
        )
    return NamedToolChoice(function=NamedFunction(choice.name))


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    format = body.text.format if body.text is not None else None
    if format is None or format.type == "text":
        return None
    if format.type == "json_object":
        return ResponseFormat(type="json_object")
    if format.schema is None:
        raise bad_request("text.format of type json_schema needs schema, the JSON Schema to follow.", "text")
    spec = JSONSchemaFormat(
        name=format.name or "response",
        schema=format.schema,
        strict=format.strict,
        description=format.description,
    )
    return ResponseFormat(type="json_schema", json_schema=spec)
