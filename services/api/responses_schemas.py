"""The Responses API's bodies (``POST /v1/responses``), as msgspec Structs.

The request refuses unknown fields like the chat request (see
``services.api.unknown_fields``); its items accept the fields OpenAI's own
output items carry, so a client may send a response's output back as input.
``services.api.field_table.RESPONSES`` says what each top-level field does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from services.api.openai_schemas import Count

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A text part of a message (``input_text``, ``output_text``) or of a reasoning item."""

    type: str
    text: str | None = None
    # What an output_text part carries when a response's output is sent back: not read.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One item of ``input``: a message, a function call, its output, or earlier reasoning."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None
    # Carried by items a client sends back; ids and statuses are not read.
    id: str | None = None
    status: str | None = None
    phase: str | None = None
    encrypted_content: None = None  # weft never hands out encrypted reasoning


class FunctionTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool in the Responses shape: flat, ``{"type": "function", "name": ..., "parameters": ...}``."""

    type: str
    name: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused when set


class ReasoningConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(msgspec.Struct, kw_only=True):
    include_obfuscation: bool = False


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None  # only empty
    truncation: Literal["auto", "disabled"] | None = None  # only "disabled"
    # OpenAI's, accepted without effect (prefix caching is automatic; one tier; no accounts).
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # OpenAI's fields weft refuses whenever set (field_table says why).
    access_programs: Any = None
    background: Any = None
    background_options: Any = None
    context_management: Any = None
    conversation: Any = None
    image: Any = None
    max_tool_calls: Any = None
    moderation: Any = None
    prompt: Any = None
    top_logprobs: Any = None


# ---- the response ------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(msgspec.Struct, kw_only=True):
    text: str
    type: Literal["reasoning_text"] = "reasoning_text"


class MessageItem(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = []
    status: str = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tool_choice: Any = "auto"
    tools: list[FunctionTool] = []
    truncation: str = "disabled"
    user: str | None = None
    background: bool = False
    object: Literal["response"] = "response"


class StoredResponse(msgspec.Struct):
    """What the store keeps of a response: itself, and the conversation it ended
    (its input items, earlier turns included, then its output) for ``previous_response_id``."""

    response: ResponseObject
    conversation: list[InputItem]
