"""OpenAI request and response bodies, as msgspec Structs.

Requests are decoded straight from the HTTP body with ``decode_body``, so a
wrong type comes back as a 400 naming the field's path (``$.messages[0].role``).
The completion and chat requests refuse unknown fields (a 400 naming them,
see ``services.api.unknown_fields``): a misspelt parameter must not be
silently dropped. ``services.api.field_table`` says what each field does.
Every integer carries bounds, since JSON integers are unbounded and an
out-of-range one must be a 400 here, never an overflow deeper down.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from protocol import StructuredOutputsParams
from protocol.kv_transfer import KVTransferParams

T = TypeVar("T")

# The range of a C long long: what a seed or a token id may hold downstream.
_INT64 = Meta(ge=-(2**63), le=2**63 - 1)
Int64 = Annotated[int, _INT64]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
# vLLM's default --max-logprobs: the most top logprobs one position may ask for.
MAX_LOGPROBS = 20
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]

Prompt = str | list[str | TokenId | list[TokenId]]


def decode_body(body: bytes, type: type[T]) -> T:
    """Decode a JSON body against ``type``; raises ``msgspec.ValidationError``
    (wrong shape, with the field's path) or ``msgspec.DecodeError`` (not JSON)."""
    return msgspec.json.decode(body, type=type)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Count = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Priority = 0
    cache_salt: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs,
    # and the older guided_* fields many clients still send.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Disaggregated prefill/decode (vLLM's field): set by the P/D proxy.
    kv_transfer_params: KVTransferParams | None = None
    # OpenAI's token id (a string in JSON) -> bias; vLLM's token filters.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # OpenAI's, accepted without effect on a self-hosted server.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    prompt: Prompt
    max_tokens: Count | None = 16
    logprobs: NumLogprobs | None = None
    add_special_tokens: bool = True
    echo: bool = False
    suffix: str | None = None  # refused
    best_of: Count | None = None  # only equal to n
    prompt_logprobs: NumLogprobs | None = None  # vLLM's


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    """A call the assistant made: in a request's history and in a response."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: which call it answers
    reasoning_content: str | None = None  # an assistant's earlier thinking (vLLM's)


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming the one function the model must call."""

    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # unset: "auto" when tools are given (vLLM)
    parallel_tool_calls: bool = True
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the final message's content leads the reply when it is the reply's role
    # OpenAI's fields weft refuses whenever set (field_table says why).
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    # Handed to the chat template as ``reasoning_effort`` (templates that do not take it ignore it).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # OpenAI's, accepted without effect (prefix caching is automatic).
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # The chat options that change the rendered prompt, as on chat completions.
    tools: list[ChatTool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


# ---- responses -------------------------------------------------------------


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/embeddings (OpenAI's fields, and vLLM's add_special_tokens)."""

    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None
    user: str | None = None
    add_special_tokens: bool = True


class EmbeddingData(msgspec.Struct, kw_only=True):
    object: str = "embedding"
    index: int
    # A list of floats, or base64 of their little-endian float32 bytes.
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(msgspec.Struct):
    """vLLM's shape of one token's entry in ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: per prompt position (the first is null), token id -> logprob.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: Literal["text_completion"] = "text_completion"
    kv_transfer_params: KVTransferParams | None = None  # what a decode engine needs (P/D)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob] = []


class ChatChoiceLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatReasoningMessage(ChatResponseMessage):
    """The message of a server with ``--reasoning-parser``: the thinking apart from
    the content, under vLLM's older name and its newer one."""

    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage  # or a ChatReasoningMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    object: Literal["chat.completion"] = "chat.completion"
    kv_transfer_params: KVTransferParams | None = None  # what a decode engine needs (P/D)


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed tool call: the first names it (id, type, name), the rest add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: a piece of the thinking
    reasoning: str | None = None  # the same, under vLLM's newer name


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: Literal["text_completion"] = "text_completion"


class ChatCompletionFinalChunk(ChatCompletionChunk):
    """A choice's last chunk when the engine handed back ``kv_transfer_params``
    (only then: other chunks do not carry the field at all)."""

    kv_transfer_params: KVTransferParams | None = None


class CompletionFinalChunk(CompletionChunk):
    """See ``ChatCompletionFinalChunk``."""

    kv_transfer_params: KVTransferParams | None = None


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)
