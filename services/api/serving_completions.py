"""POST /v1/completions: prompts in, text out, streamed or whole.

``echo`` puts each prompt's text in front of its choices' text (in the first
chunk when streaming) and, with ``logprobs``, the prompt tokens' logprobs in
front of the output's, the first one null (nothing predicts it), as vLLM
does. With ``max_tokens: 0`` echo answers the prompt alone (finish_reason
"length"): like vLLM, the engine runs the prompt for one token (its
logprobs come from that pass), which is not shown nor counted. ``prompt_logprobs`` (vLLM's) comes back per choice, keyed by token id.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from services.api import serving
from services.api.errors import bad_request
from services.api.field_table import COMPLETIONS, refuse_unsupported
from services.api.offload import run_blocking
from services.api.openai_schemas import (
    CompletionChoice,
    CompletionChunk,
    CompletionFinalChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Prompt,
    PromptLogprob,
    encode,
)
from services.api.output_processor import Logprob
from services.api.serving import Choice, ServingContext
from services.api.streaming import SSEResponse, unless_disconnected, usage_modes


def prompt_token_lists(
    ctx: ServingContext, prompt: Prompt, add_special_tokens: bool, param: str = "prompt"
) -> list[list[int]]:
    """OpenAI's four prompt shapes -> one token list per prompt (``param``: the field, for errors)."""
    if isinstance(prompt, str):
        return [ctx.tokenizer.encode(prompt, add_special_tokens)]
    if not prompt:
        raise bad_request(f"The {param} list is empty.", param)
    kinds = {type(p) for p in prompt}
    if len(kinds) > 1:
        raise bad_request(
            f"A {param} list must hold only strings, only token ids, or only lists of token ids.", param
        )
    if kinds == {int}:
        return [list(prompt)]  # type: ignore[arg-type]
    if kinds == {str}:
        return [ctx.tokenizer.encode(p, add_special_tokens) for p in prompt]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def check_prompt_size(ctx: ServingContext, prompt: Prompt, param: str = "prompt") -> None:
    """The prompt count and text size limits, before tokenizing."""
    if isinstance(prompt, str):
        ctx.limits.check_text_size([prompt], param)
        return
    if not prompt or isinstance(prompt[0], int):
        return  # token ids (one prompt, no text); a list mixing kinds is refused before any work
    ctx.limits.check_prompt_count(len(prompt), param)
    ctx.limits.check_text_size((p for p in prompt if isinstance(p, str)), param)


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request, body: CompletionRequest) -> Response:
        arrival = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        check_completion_fields(body)
        serving.check_kv_transfer_caller(ctx, request, body)
        check_prompt_size(ctx, body.prompt)  # before tokenizing
        prompts = await run_blocking(prompt_token_lists, ctx, body.prompt, body.add_special_tokens)
        ctx.check_num_sequences(len(prompts), body.n)  # before any per-prompt work
        prompt_only = body.echo and body.max_tokens == 0
        if prompt_only and body.min_tokens:
            raise bad_request("min_tokens must be 0 when max_tokens is 0.", "min_tokens")
        request_id = serving.new_request_id("cmpl", request)
        session = serving.session_key(request, body)
        # Checks, sampling parameters and engine requests, once for the whole request, off the loop.
        choices = await run_blocking(
            completion_choices, ctx, request_id, body, prompts, prompt_only, arrival, session
        )
        runner = ctx.admit(request, choices)  # 503 + Retry-After when the engines are full
        include_usage, continuous = usage_modes(ctx.options, body)
        view = _CompletionView(
            request_id,
            int(time.time()),
            ctx.served_model_name,
            _echo_texts(ctx, body, prompts),
            body.logprobs,
            continuous,
            show_prompt_logprobs=body.prompt_logprobs is not None,
        )
        if body.stream:
            usage = (lambda: view.usage_chunk(choices)) if include_usage else None
            return SSEResponse(serving.sse_events(runner, view.chunk, usage_chunk=usage))
        await unless_disconnected(request, serving.collect(runner))
        if view.shows_prompt_logprobs:  # up to --max-prompt-logprob-entries to encode
            body_bytes = await run_blocking(lambda: encode(view.response(choices)))
        else:
            body_bytes = encode(view.response(choices))
        return Response(body_bytes, media_type="application/json")


def completion_choices(
    ctx: ServingContext,
    request_id: str,
    body: CompletionRequest,
    prompts: list[list[int]],
    prompt_only: bool,
    arrival: float,
    session: str | None,
) -> list[Choice]:
    """The request's engine requests: every prompt checked, the sampling parameters built
    once (bad words tokenized once, filters checked once) and given each prompt's max_tokens."""
    asked = 1 if prompt_only else body.max_tokens
    max_tokens = []
    for prompt in prompts:
        serving.check_prompt_ids(ctx, prompt, "prompt")
        max_tokens.append(serving.resolve_max_tokens(ctx, asked, len(prompt), "max_tokens"))
    num_prompt_logprobs = _prompt_logprobs(body)
    serving.check_prompt_logprobs_budget(ctx, prompts, body.n, num_prompt_logprobs)
    params = serving.make_sampling_params(ctx, body, max_tokens[0], body.logprobs, num_prompt_logprobs)
    return serving.make_choices(
        ctx,
        request_id,
        prompts,
        serving.per_prompt(params, max_tokens),
        body,
        arrival,
        session,
        prompt_only,
        # A stream shows each choice's echo as it goes: each computes its own there.
        share_prompt_logprobs=not body.stream,
    )


def check_completion_fields(body: CompletionRequest) -> None:
    refuse_unsupported(body, COMPLETIONS)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(
            f"best_of must equal n ({body.n}) or be left out: weft returns every sequence "
            f"it generates, got best_of={body.best_of}.",
            "best_of",
        )
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs is not available when stream is true.", "prompt_logprobs")


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many top prompt logprobs the engine must compute: those asked for, and
    with echo and logprobs the same count as the output's (vLLM's rule)."""
    asked = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
    return max(asked, default=None)


def _echo_texts(ctx: ServingContext, body: CompletionRequest, prompts: list[list[int]]) -> list[str] | None:
    """Per prompt, the text echo puts in front (a text prompt as sent, token ids decoded)."""
    if not body.echo:
        return None
    if isinstance(body.prompt, str):
        return [body.prompt]
    if body.prompt and all(isinstance(p, str) for p in body.prompt):
        return list(body.prompt)  # type: ignore[arg-type]
    return [ctx.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]


class _CompletionView:
    """Turns choices into OpenAI's completion objects."""

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        echo_texts: list[str] | None = None,
        logprobs: int | None = None,
        continuous_usage: bool = False,
        show_prompt_logprobs: bool = False,
    ) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self._show_prompt_logprobs = show_prompt_logprobs
        self._echo_texts = echo_texts
        self._echo_logprobs = echo_texts is not None and logprobs is not None
        self._continuous_usage = continuous_usage
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        self._echoed: set[int] = set()  # choices whose prompt text went out
        self._prompt_entries_sent: dict[int, int] = {}  # choice index -> prompt logprobs shown

    @property
    def shows_prompt_logprobs(self) -> bool:
        return self._show_prompt_logprobs or self._echo_logprobs

    def chunk(self, choice: Choice) -> CompletionChunk | None:
        echo = self._take_echo(choice)
        text = echo + choice.state.detokenizer.take_delta(choice.done)
        entries = self._take_prompt_entries(choice) + choice.take_logprobs()
        if not text and not entries and not choice.done:
            return None
        shown = [self._choice(choice, text, entries)]
        usage = serving.choice_usage(choice) if self._continuous_usage else None
        if choice.done and choice.state.kv_transfer_params is not None:
            return CompletionFinalChunk(
                self.request_id,
                self.created,
                self.model,
                shown,
                usage,
                kv_transfer_params=choice.state.kv_transfer_params,
            )
        return CompletionChunk(self.request_id, self.created, self.model, shown, usage)

    def _take_echo(self, choice: Choice) -> str:
        if self._echo_texts is None or choice.index in self._echoed:
            return ""
        self._echoed.add(choice.index)
        return self._echo_texts[choice.prompt_index]

    def _take_prompt_entries(self, choice: Choice) -> list[dict[int, Logprob] | None]:
        """Prompt logprob entries not shown yet, when echo shows them (None for the first token)."""
        if not self._echo_logprobs:
            return []
        entries = choice.prompt_logprobs or []
        sent = self._prompt_entries_sent.get(choice.index, 0)
        self._prompt_entries_sent[choice.index] = len(entries)
        return entries[sent:]

    def usage_chunk(self, choices: list[Choice]) -> CompletionChunk:
        return CompletionChunk(self.request_id, self.created, self.model, [], usage=serving.usage_of(choices))

    def response(self, choices: list[Choice]) -> CompletionResponse:
        shown = []
        for c in choices:
            choice = self._choice(
                c, self._take_echo(c) + c.state.text, [*self._take_prompt_entries(c), *c.take_logprobs()]
            )
            if self._show_prompt_logprobs:
                choice.prompt_logprobs = _prompt_logprobs_shown(c)
            shown.append(choice)
        return CompletionResponse(
            self.request_id,
            self.created,
            self.model,
            shown,
            serving.usage_of(choices),
            kv_transfer_params=serving.kv_transfer_params_of(choices),
        )

    def _choice(
        self, choice: Choice, text: str, entries: list[dict[int, Logprob] | None]
    ) -> CompletionChoice:
        logprobs = None
        if choice.state.logprobs is not None:
            logprobs = self._logprobs(choice, entries)
        finish = choice.state.finish_reason if choice.done else None
        stop = choice.state.stop_reason if choice.done else None
        return CompletionChoice(choice.index, text, logprobs, finish, stop)

    def _logprobs(self, choice: Choice, entries: list[dict[int, Logprob] | None]) -> CompletionLogprobs:
        top_n = choice.request.sampling_params.logprobs or 0
        result = CompletionLogprobs()
        offset = self._offsets.get(choice.index, 0)
        for entry in entries:
            if entry is None:  # the prompt's first token: nothing predicts it
                token = _first_prompt_token(choice)
                result.tokens.append(token)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                result.text_offset.append(offset)
                offset += len(token)
                continue
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


def _first_prompt_token(choice: Choice) -> str:
    return choice.state.tokenizer.decode(choice.request.prompt_token_ids[:1], skip_special_tokens=False)


def _prompt_logprobs_shown(choice: Choice) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs``: per position, token id (as a JSON key) -> its entry."""
    entries = choice.prompt_logprobs
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(token_id): PromptLogprob(serving.shown_logprob(lp.logprob), lp.rank, lp.decoded_token)
            for token_id, lp in e.items()
        }
        for e in entries
    ]


def _rank(lp: Logprob) -> int:
    return lp.rank if lp.rank is not None else 1 << 62
