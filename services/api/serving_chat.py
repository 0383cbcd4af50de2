"""POST /v1/chat/completions: messages through the chat template, then text."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from services.api import serving
from services.api.errors import bad_request
from services.api.openai_schemas import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionFinalChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
    encode,
)
from services.api.output_processor import Logprob
from services.api.serving import Choice, ServingContext
from services.api.streaming import SSEResponse, unless_disconnected


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages as the chat template sees them (text parts joined)."""
    if not messages:
        raise bad_request("messages must hold at least one message.", "messages")
    result = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("Only text content parts are supported.", f"messages[{i}].content")
            content = "".join(part.text for part in content)  # type: ignore[misc]
        message = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        result.append(message)
    return result


def chat_prompt_ids(ctx: ServingContext, messages: list[ChatMessage],
                    add_generation_prompt: bool) -> list[int]:
    dicts = message_dicts(messages)
    try:
        text = ctx.tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)
    # The template is code run on the client's messages: whatever it raises
    # (raise_exception, a None where it wants a string...) is a bad request.
    except Exception as e:
        raise bad_request(f"The chat template could not render these messages: {e}",
                          "messages") from e
    # The template already wrote the special tokens it wants.
    return ctx.tokenizer.encode(text, add_special_tokens=False)


class ChatServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request, body: ChatCompletionRequest) -> Response:
        arrival = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        serving.check_kv_transfer_caller(ctx, request, body)
        prompt = chat_prompt_ids(ctx, body.messages, body.add_generation_prompt)
        serving.check_prompt_ids(ctx, prompt, "messages")
        if body.max_completion_tokens is not None:
            max_tokens = serving.resolve_max_tokens(ctx, body.max_completion_tokens, len(prompt),
                                                    "max_completion_tokens")
        else:
            max_tokens = serving.resolve_max_tokens(ctx, body.max_tokens, len(prompt), "max_tokens")
        params = serving.make_sampling_params(ctx, body, max_tokens, _num_logprobs(body))
        request_id = serving.new_request_id("chatcmpl")
        choices = serving.make_choices(ctx, request_id, [prompt], [params], body, arrival)
        runner = ctx.admit(request, choices)  # 503 + Retry-After when the engines are full
        view = _ChatView(request_id, int(time.time()), ctx.served_model_name)
        if body.stream:
            usage = (lambda: view.usage_chunk(choices)) if body.include_usage else None
            return SSEResponse(serving.sse_events(runner, view.chunk, head=view.role_chunks(choices),
                                                  usage_chunk=usage))
        await unless_disconnected(request, serving.collect(runner))
        return Response(encode(view.response(choices)), media_type="application/json")


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


class _ChatView:
    """Turns choices into OpenAI's chat completion objects."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self.request_id, self.created, self.model = request_id, created, model

    def role_chunks(self, choices: list[Choice]) -> tuple[ChatCompletionChunk, ...]:
        # OpenAI's first chunk of each choice names the role, with empty content.
        return tuple(self._chunk([ChatStreamChoice(c.index, DeltaMessage("assistant", ""))])
                     for c in choices)

    def chunk(self, choice: Choice) -> ChatCompletionChunk | None:
        text = choice.state.detokenizer.take_delta(choice.done)
        entries = choice.take_logprobs()
        if not text and not entries and not choice.done:
            return None
        logprobs = self._logprobs(choice, entries)
        finish, stop = _finish(choice)
        delta = DeltaMessage(content=text) if text or not choice.done else DeltaMessage()
        shown = [ChatStreamChoice(choice.index, delta, logprobs, finish, stop)]
        if choice.done and choice.state.kv_transfer_params is not None:
            return ChatCompletionFinalChunk(self.request_id, self.created, self.model, shown,
                                            kv_transfer_params=choice.state.kv_transfer_params)
        return self._chunk(shown)

    def usage_chunk(self, choices: list[Choice]) -> ChatCompletionChunk:
        return self._chunk([], usage=serving.usage_of(choices))

    def response(self, choices: list[Choice]) -> ChatCompletionResponse:
        shown = []
        for c in choices:
            message = ChatResponseMessage("assistant", c.state.text)
            finish, stop = _finish(c)
            shown.append(ChatChoice(c.index, message, self._logprobs(c, c.take_logprobs()), finish, stop))
        return ChatCompletionResponse(self.request_id, self.created, self.model, shown,
                                      serving.usage_of(choices),
                                      kv_transfer_params=serving.kv_transfer_params_of(choices))

    def _chunk(self, choices: list[ChatStreamChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.request_id, self.created, self.model, choices, usage)

    def _logprobs(self, choice: Choice, entries: list[dict[int, Logprob]]) -> ChatChoiceLogprobs | None:
        if choice.state.logprobs is None:
            return None
        top_n = choice.request.sampling_params.logprobs or 0
        return ChatChoiceLogprobs([_entry(e, top_n) for e in entries])


def _finish(choice: Choice) -> tuple[str | None, int | str | None]:
    if not choice.done:
        return None, None
    return choice.state.finish_reason, choice.state.stop_reason


def _entry(entry: dict[int, Logprob], top_n: int) -> ChatLogprobEntry:
    chosen = next(iter(entry.values()))  # the sampled token comes first
    ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n),
                    key=lambda lp: lp.rank)
    top = [TopLogprob(_token(lp), serving.shown_logprob(lp.logprob), _bytes(lp)) for lp in ranked]
    return ChatLogprobEntry(_token(chosen), serving.shown_logprob(chosen.logprob), _bytes(chosen), top)


def _token(lp: Logprob) -> str:
    return lp.decoded_token or ""


def _bytes(lp: Logprob) -> list[int]:
    return list(_token(lp).encode("utf-8", errors="replace"))
