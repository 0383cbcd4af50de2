"""POST /v1/completions: prompts in, text out, streamed or whole."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from services.api import serving
from services.api.errors import bad_request
from services.api.offload import run_blocking
from services.api.openai_schemas import (
    CompletionChoice,
    CompletionChunk,
    CompletionFinalChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Prompt,
    encode,
)
from services.api.output_processor import Logprob
from services.api.serving import Choice, ServingContext
from services.api.streaming import SSEResponse, unless_disconnected


def prompt_token_lists(ctx: ServingContext, prompt: Prompt, add_special_tokens: bool) -> list[list[int]]:
    """OpenAI's four prompt shapes -> one token list per prompt."""
    if isinstance(prompt, str):
        return [ctx.tokenizer.encode(prompt, add_special_tokens)]
    if not prompt:
        raise bad_request("The prompt list is empty.", "prompt")
    kinds = {type(p) for p in prompt}
    if len(kinds) > 1:
        raise bad_request("A prompt list must hold only strings, only token ids, or only "
                          "lists of token ids.", "prompt")
    if kinds == {int}:
        return [list(prompt)]  # type: ignore[arg-type]
    if kinds == {str}:
        return [ctx.tokenizer.encode(p, add_special_tokens) for p in prompt]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def _check_prompt_size(ctx: ServingContext, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        ctx.limits.check_text_size([prompt], "prompt")
        return
    if not prompt or isinstance(prompt[0], int):
        return  # token ids (one prompt, no text); a list mixing kinds is refused before any work
    ctx.limits.check_prompt_count(len(prompt))
    ctx.limits.check_text_size((p for p in prompt if isinstance(p, str)), "prompt")


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request, body: CompletionRequest) -> Response:
        arrival = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        _check_prompt_size(ctx, body.prompt)  # before tokenizing
        prompts = await run_blocking(prompt_token_lists, ctx, body.prompt, body.add_special_tokens)
        ctx.check_num_sequences(len(prompts), body.n)  # before any per-prompt work
        params = []
        for prompt in prompts:
            serving.check_prompt_ids(ctx, prompt, "prompt")
            max_tokens = serving.resolve_max_tokens(ctx, body.max_tokens, len(prompt), "max_tokens")
            params.append(serving.make_sampling_params(ctx, body, max_tokens, body.logprobs))
        request_id = serving.new_request_id("cmpl")
        choices = serving.make_choices(ctx, request_id, prompts, params, body, arrival,
                                       serving.session_key(request, body))
        runner = ctx.admit(request, choices)  # 503 + Retry-After when the engines are full
        view = _CompletionView(request_id, int(time.time()), ctx.served_model_name)
        if body.stream:
            usage = (lambda: view.usage_chunk(choices)) if body.include_usage else None
            return SSEResponse(serving.sse_events(runner, view.chunk, usage_chunk=usage))
        await unless_disconnected(request, serving.collect(runner))
        return Response(encode(view.response(choices)), media_type="application/json")


class _CompletionView:
    """Turns choices into OpenAI's completion objects."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    def chunk(self, choice: Choice) -> CompletionChunk | None:
        text = choice.state.detokenizer.take_delta(choice.done)
        entries = choice.take_logprobs()
        if not text and not entries and not choice.done:
            return None
        shown = [self._choice(choice, text, entries)]
        if choice.done and choice.state.kv_transfer_params is not None:
            return CompletionFinalChunk(self.request_id, self.created, self.model, shown,
                                        kv_transfer_params=choice.state.kv_transfer_params)
        return CompletionChunk(self.request_id, self.created, self.model, shown)

    def usage_chunk(self, choices: list[Choice]) -> CompletionChunk:
        return CompletionChunk(self.request_id, self.created, self.model, [],
                               usage=serving.usage_of(choices))

    def response(self, choices: list[Choice]) -> CompletionResponse:
        shown = [self._choice(c, c.state.text, c.take_logprobs()) for c in choices]
        return CompletionResponse(self.request_id, self.created, self.model, shown,
                                  serving.usage_of(choices),
                                  kv_transfer_params=serving.kv_transfer_params_of(choices))

    def _choice(self, choice: Choice, text: str, entries: list[dict[int, Logprob]]) -> CompletionChoice:
        logprobs = None
        if choice.state.logprobs is not None:
            logprobs = self._logprobs(choice, entries)
        finish = choice.state.finish_reason if choice.done else None
        stop = choice.state.stop_reason if choice.done else None
        return CompletionChoice(choice.index, text, logprobs, finish, stop)

    def _logprobs(self, choice: Choice, entries: list[dict[int, Logprob]]) -> CompletionLogprobs:
        top_n = choice.request.sampling_params.logprobs or 0
        result = CompletionLogprobs()
        offset = self._offsets.get(choice.index, 0)
        for entry in entries:
            chosen = next(iter(entry.values()))  # the sampled token comes first
            token = chosen.decoded_token or ""
            result.tokens.append(token)
            result.token_logprobs.append(serving.shown_logprob(chosen.logprob))
            top = {token: serving.shown_logprob(chosen.logprob)}
            for lp in sorted(entry.values(), key=_rank):
                if lp.rank is not None and lp.rank <= top_n:
                    top.setdefault(lp.decoded_token or "", serving.shown_logprob(lp.logprob))
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(token)
        self._offsets[choice.index] = offset
        return result


def _rank(lp: Logprob) -> int:
    return lp.rank if lp.rank is not None else 1 << 62
