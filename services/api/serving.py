"""What completions and chat share: checks, engine requests, and running them.

A request with ``n`` choices (and, for completions, several prompts) becomes
one engine request per choice. ``ChoiceRunner`` drives them all at once,
one task per choice, and hands the route a single ordered stream of
"choice X changed" updates; the route decides how to show them (SSE chunks
or one JSON body). Leaving the runner early, for whatever reason, aborts
every engine request still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from starlette.requests import Request

from protocol import EngineConfig, EngineCoreRequest, SamplingParams
from protocol.kv_transfer import KVTransferParams
from services.api.admission import Admission, hold_ticket
from services.api.api_options import APIOptions
from services.api.engine_client import EngineClient, EngineDeadError, EngineNotReadyError
from services.api.errors import APIError, bad_request, error_body, unavailable
from services.api.limits import ServingLimits
from services.api.metrics import APIMetrics, RequestMetrics
from services.api.offload import run_blocking
from services.api.openai_schemas import EmbeddingRequest, PromptTokensDetails, SamplingFields, UsageInfo
from services.api.output_processor import Logprob, RequestState
from services.api.prefix_router import session_key_of
from services.api.redact import redact
from services.api.request_id import request_id_of
from services.api.streaming import DONE, check_stream_options, sse
from services.api.structured_outputs import structured_outputs_from
from services.api.token_filters import token_filters
from services.api.tokenizer import Tokenizer
from services.generation_config import model_default, with_extra_eos
from services.kv_transfer.trust import require_trusted_caller

logger = logging.getLogger(__name__)

_INT64_MOD = 2**64
_LOGPROB_FLOOR = -9999.0  # what -inf is shown as: JSON has no infinities
T = TypeVar("T")
# What a runner's queue carries: a choice that changed (and whether it is done), or the error that ends all.
_Update = tuple["Choice", bool] | BaseException


@dataclass
class ServingContext:
    engine_client: EngineClient
    tokenizer: Tokenizer
    config: EngineConfig
    served_model_name: str
    metrics: APIMetrics
    admission: Admission  # built from the same limits
    limits: ServingLimits = field(default_factory=ServingLimits)
    options: APIOptions = field(default_factory=APIOptions)
    kv_transfer_secret: str | None = None  # the P/D proxy's (services.kv_transfer.trust)
    model_aliases: tuple[str, ...] = ()  # more names accepted in `model` (--served-model-name A B ...)

    @property
    def max_model_len(self) -> int:
        """The engines' context: the config's, or what they lowered it to (their ready message)."""
        reported = self.engine_client.max_model_len
        return self.config.model.max_model_len if reported is None else reported

    @property
    def vocab_size(self) -> int:
        # ModelConfig's default of 1 means "not filled in": trust the tokenizer then.
        configured = self.config.model.vocab_size
        return configured if configured > 1 else self.tokenizer.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return (
            self.tokenizer.eos_token_id
            if self.tokenizer.eos_token_id is not None
            else self.config.model.eos_token_id
        )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name and model not in self.model_aliases:
            raise bad_request(
                f"The model `{model}` does not exist; this server serves `{self.served_model_name}`.", "model"
            )

    def check_num_sequences(self, num_prompts: int, n: int, prompt_param: str = "prompt") -> None:
        """400 for more choices than this server serves in one request."""
        if n > self.limits.max_n:
            raise bad_request(f"n must be at most {self.limits.max_n}, got {n}.", "n")
        if num_prompts * n > self.admission.per_rank:
            raise bad_request(
                f"{num_prompts} prompt(s) x n={n} is more sequences than one engine takes "
                f"at once ({self.admission.per_rank}).",
                "n" if num_prompts == 1 else prompt_param,
            )

    def admit(self, request: Request, choices: list[Choice]) -> ChoiceRunner:
        """The runner of ``choices`` if the engines have room for them (else a
        503 with Retry-After); their slots come back when the HTTP exchange ends."""
        ticket = self.admission.admit(len(choices))
        timeout = self.limits.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        runner = ChoiceRunner(self.engine_client, choices, deadline=deadline)
        hold_ticket(request.scope, ticket, runner)
        return runner


def new_request_id(prefix: str, request: Request | None = None) -> str:
    """The response's id: ``prefix-`` and the exchange's X-Request-Id (the client's, or the one
    ``services/api/request_id.py`` made), or a new one outside that middleware."""
    given = request_id_of(request.scope) if request is not None else None
    return f"{prefix}-{given or uuid.uuid4().hex}"


def engine_request_ids(request_id: str, count: int) -> list[str]:
    """The ids of a request's ``count`` engine requests: unique even when two clients send the
    same X-Request-Id, and ending in the choice's index."""
    nonce = secrets.token_hex(4)
    return [f"{request_id}-{nonce}-{index}" for index in range(count)]


def check_prompt_ids(
    ctx: ServingContext, token_ids: list[int], param: str, prompt_only: bool = False
) -> None:
    """``prompt_only``: nothing is generated after it (embeddings), so it may fill the context."""
    if not token_ids:
        raise bad_request("The prompt is empty; send at least one token.", param)
    if max(token_ids) >= ctx.vocab_size:
        raise bad_request(
            f"Token id {max(token_ids)} is out of the vocabulary (size {ctx.vocab_size}).", param
        )
    if prompt_only and len(token_ids) > ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens, and the input "
            f"has {len(token_ids)} tokens.",
            param,
        )
    if not prompt_only and len(token_ids) >= ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens, and the prompt "
            f"has {len(token_ids)} tokens, which leaves no room to generate.",
            param,
        )
    limit = ctx.limits.max_prompt_tokens
    if limit is not None and len(token_ids) > limit:
        raise bad_request(
            f"The prompt has {len(token_ids)} tokens; this server takes at most {limit}.", param
        )


def resolve_max_tokens(ctx: ServingContext, requested: int | None, prompt_len: int, param: str) -> int:
    """``None`` fills the context (up to the server's cap); more than fits is
    the client's error."""
    room = ctx.max_model_len - prompt_len
    cap = ctx.limits.max_tokens
    if requested is None:
        room = min(room, int(model_default(ctx.config.model, "max_tokens", room)))
        return room if cap is None else min(room, cap)
    if cap is not None and requested > cap:
        raise bad_request(f"{param} ({requested}) is more than this server allows ({cap}).", param)
    if requested > room:
        raise bad_request(
            f"{param} ({requested}) plus the prompt ({prompt_len} tokens) is more than this "
            f"model's maximum context length ({ctx.max_model_len} tokens).",
            param,
        )
    return requested


def check_finite(body: msgspec.Struct, fields: tuple[str, ...]) -> None:
    for name in fields:
        value = getattr(body, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value!r}.", name)


def make_sampling_params(
    ctx: ServingContext,
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams from the fields completions and chat share; 400 on bad values."""
    check_finite(
        body, ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    )
    if body.priority != 0 and ctx.config.scheduler.scheduling_policy != "priority":
        raise bad_request("priority is only allowed when the server schedules by priority.", "priority")
    if body.cache_salt is not None and not body.cache_salt:
        raise bad_request("cache_salt must be a non-empty string.", "cache_salt")
    check_stream_options(body)
    ctx.check_num_sequences(1, body.n)
    ctx.limits.check_stop_lists(body.stop, body.stop_token_ids)
    structured_outputs = structured_outputs_from(body)  # 400 when invalid
    default = functools.partial(model_default, ctx.config.model)  # generation_config.json's, else ours
    try:
        params = SamplingParams(
            n=body.n,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=_or(body.repetition_penalty, default("repetition_penalty", 1.0)),
            temperature=_or(body.temperature, default("temperature", 1.0)),
            top_p=_or(body.top_p, default("top_p", 1.0)),
            top_k=_or(body.top_k, default("top_k", 0)),
            min_p=_or(body.min_p, default("min_p", 0.0)),
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=structured_outputs,
            **token_filters(
                ctx.tokenizer,
                ctx.vocab_size,
                body,
                ctx.limits,
                ctx.limits.max_prompt_tokens or ctx.max_model_len,
            ),
        )
        return with_extra_eos(params, ctx.config.model.extra_eos_token_ids)
    except ValueError as e:
        # SamplingParams' messages start with the field's name.
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from e


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def per_prompt(params: SamplingParams, max_tokens: list[int]) -> list[SamplingParams]:
    """One prompt's parameters each: ``params`` with that prompt's ``max_tokens`` (shared where
    they agree, so a request's filters are checked once, not once a prompt)."""
    made = {params.max_tokens: params}
    try:
        for m in max_tokens:
            if m not in made:
                made[m] = msgspec.structs.replace(params, max_tokens=m)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from e
    return [made[m] for m in max_tokens]


def check_prompt_logprobs_budget(
    ctx: ServingContext, prompts: list[list[int]], n: int, k: int | None
) -> None:
    """400 when ``n x prompt tokens x (k + 1)``, over the prompts, passes --max-prompt-logprob-entries:
    that many entries are computed, converted and sent back (k = -1: the whole vocabulary)."""
    if k is None:
        return
    per_token = (ctx.vocab_size if k == -1 else k) + 1
    entries = n * sum(len(p) for p in prompts) * per_token
    limit = ctx.limits.max_prompt_logprob_entries
    if entries > limit:
        raise bad_request(
            f"prompt_logprobs would return {entries} entries (n x prompt tokens x (prompt_logprobs + 1)); "
            f"this server returns at most {limit} (--max-prompt-logprob-entries).",
            "prompt_logprobs",
        )


@dataclass
class Choice:
    """One engine request, seen as one choice of the response."""

    index: int
    prompt_index: int
    request: EngineCoreRequest
    state: RequestState
    metrics: RequestMetrics
    logprobs_sent: int = 0  # entries of ``state.logprobs`` already shown
    # Set when the route reaches this choice's last update. The engine side
    # may be further on (``state`` already finished) while earlier updates
    # are still being shown, so views must go by this flag, not by ``state``.
    done: bool = False
    # The sibling (same prompt) whose engine request computes the prompt's logprobs for both.
    prompt_logprobs_from: Choice | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt's logprob entries (computed once per prompt, by its first choice)."""
        source = self.prompt_logprobs_from or self
        return source.state.prompt_logprobs

    def take_logprobs(self) -> list[dict[int, Logprob]]:
        """Logprob entries not shown yet (one dict per token)."""
        entries = self.state.logprobs or []
        new = entries[self.logprobs_sent :]
        self.logprobs_sent = len(entries)
        return new


def check_kv_transfer_caller(ctx: ServingContext, request: Request, body: SamplingFields) -> None:
    """P/D parameters steer what an engine loads and saves: only the P/D proxy may set them (403).

    Checked whatever the API's own config says: an engine core started with
    its own ``--kv-transfer-config`` may be a consumer behind an API that has none."""
    if body.kv_transfer_params is not None:
        require_trusted_caller(request.headers, ctx.kv_transfer_secret)


def session_key(request: Request, body: SamplingFields | EmbeddingRequest) -> str | None:
    """The sticky-session key the balancer falls back on: ``x-session-id``, else ``user`` (400 if huge)."""
    header = request.headers.get("x-session-id")
    try:
        return session_key_of(header, body.user)
    except ValueError as e:
        raise bad_request(str(e), "x-session-id" if header else "user") from e


def make_choices(
    ctx: ServingContext,
    request_id: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    body: SamplingFields,
    arrival: float,
    session_key: str | None = None,
    prompt_only: bool = False,
    share_prompt_logprobs: bool = False,
) -> list[Choice]:
    """Fan each prompt out into ``n`` engine requests; seeded ones get seed + i.
    ``prompt_only``: the generated token is dropped (echo with max_tokens 0).
    ``share_prompt_logprobs``: only a prompt's first choice computes its prompt logprobs
    (the others read them from it, and may take the prompt from the prefix cache)."""
    choices = []
    ids = engine_request_ids(request_id, sum(p.n for p in params))
    for p, (prompt, prompt_params) in enumerate(zip(prompts, params)):
        n = prompt_params.n
        first = None
        for i in range(n):
            index = p * n + i
            seed = None if prompt_params.seed is None else _wrap_int64(prompt_params.seed + i)
            shares = share_prompt_logprobs and i > 0
            child = _child(prompt_params, seed, None if shares else prompt_params.prompt_logprobs)
            engine_request = EngineCoreRequest(
                request_id=ids[index],
                prompt_token_ids=prompt,
                sampling_params=child,
                arrival_time=time.time(),
                eos_token_id=ctx.eos_token_id,
                priority=body.priority,
                cache_salt=body.cache_salt,
                kv_transfer_params=body.kv_transfer_params,
                session_key=session_key,
            )
            state = RequestState.create(
                engine_request.request_id, child, ctx.tokenizer, ctx.eos_token_id, prompt_only
            )
            # The request's own parameters (n, max_tokens) are observed once, by its first choice.
            metrics = ctx.metrics.request(
                len(prompt), arrival, prompt_params if i == 0 else None, request_id=request_id, sampling=child
            )
            choice = Choice(index, p, engine_request, state, metrics)
            if shares and prompt_params.prompt_logprobs is not None:
                choice.prompt_logprobs_from = first
            first = first or choice
            choices.append(choice)
    return choices


def _child(params: SamplingParams, seed: int | None, prompt_logprobs: int | None) -> SamplingParams:
    """One choice's parameters: a copy of the checked ``params`` with n = 1 and its seed. Not
    ``structs.replace``, which would check every filter list again for each of up to 256 choices;
    these fields cannot make checked parameters invalid."""
    child = copy.copy(params)
    child.n, child.seed, child.prompt_logprobs = 1, seed, prompt_logprobs
    return child


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % _INT64_MOD - 2**63


def usage_of(choices: list[Choice]) -> UsageInfo:
    """Usage of the whole request. Siblings (n > 1) share a prompt, and a later
    one finds in the cache what an earlier one just computed: the request's own
    hit, per prompt, is its least one (what the cache held before it)."""
    prompts: dict[int, Choice] = {}
    cached: dict[int, int] = {}
    for c in choices:
        prompts.setdefault(c.prompt_index, c)
        cached[c.prompt_index] = min(
            cached.get(c.prompt_index, c.state.num_cached_tokens), c.state.num_cached_tokens
        )
    prompt_tokens = sum(c.num_prompt_tokens for c in prompts.values())
    completion_tokens = sum(len(c.state.token_ids) for c in choices)
    return UsageInfo(
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
        PromptTokensDetails(sum(cached.values())),
    )


def kv_transfer_params_of(choices: list[Choice]) -> KVTransferParams | None:
    """What the engine handed back for another engine (the first choice's: all share the prompt)."""
    return choices[0].state.kv_transfer_params if choices else None


def shown_logprob(value: float) -> float:
    return value if value > _LOGPROB_FLOOR else _LOGPROB_FLOOR


def choice_usage(choice: Choice) -> UsageInfo:
    """One choice's usage so far (the continuous usage of a stream chunk, as vLLM counts it)."""
    completion = len(choice.state.token_ids)
    return UsageInfo(choice.num_prompt_tokens, completion, choice.num_prompt_tokens + completion)


def raise_if_failed(choice: Choice) -> None:
    """An engine error: 400 when the request's input was at fault (found late,
    in the engine), 500 when the engine was (a grammar refusing a sampled token)."""
    if choice.state.finish_reason == "error":
        status = 500 if choice.state.error_is_internal else 400
        raise APIError(redact(choice.state.error or "The request failed in the engine."), status)


@dataclass
class ChoiceRunner:
    """Runs every choice's engine request; ``updates()`` yields a choice each
    time it changed, the last time with ``done`` set."""

    engine_client: EngineClient
    choices: list[Choice]
    deadline: float | None = None  # time.monotonic() past which the request times out
    _queue: asyncio.Queue[_Update] = field(default_factory=asyncio.Queue)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def updates(self) -> AsyncGenerator[Choice, None]:
        assert not self._tasks, "a runner runs once"
        self._tasks = [asyncio.ensure_future(self._pump(c)) for c in self.choices]
        try:
            remaining = len(self.choices)
            while remaining:
                item = await self._next_item()
                if isinstance(item, BaseException):
                    raise item
                choice, done = item
                if done:
                    choice.done = True
                    remaining -= 1
                yield choice
        finally:
            await self._stop()

    def fail(self, error: BaseException) -> None:
        """End the request with ``error`` (the server stops); its engine requests are aborted."""
        self._queue.put_nowait(error)

    async def _next_item(self) -> _Update:
        if self.deadline is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), self.deadline - time.monotonic())
        except TimeoutError:
            return APIError("The request timed out and was aborted.", 504)

    async def _pump(self, choice: Choice) -> None:
        try:
            await self._run(choice)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surfaced to the route through the queue
            self._queue.put_nowait(e)
            return
        finish_reason = choice.state.finish_reason
        if finish_reason is None:  # the stream ended without saying why
            finish_reason = choice.state.finish_reason = "abort"
        choice.metrics.on_finish(finish_reason)
        self._queue.put_nowait((choice, True))

    async def _run(self, choice: Choice) -> None:
        # Closing the stream early (a stop string, an error, a cancelled task)
        # is what aborts the engine request: the client's generator owns ABORT.
        async with contextlib.aclosing(self.engine_client.generate(choice.request)) as outputs:
            async for output in outputs:
                if output.new_prompt_logprobs and choice.state.prompt_logprobs is not None:
                    # Up to n x prompt x (k + 1) entries to decode: not on the loop.
                    await run_blocking(choice.state.add_prompt_logprobs, output.new_prompt_logprobs)
                    output.new_prompt_logprobs = None
                choice.metrics.on_output(output)
                hit_stop = choice.state.process(output)
                if hit_stop or output.finished:
                    return
                self._queue.put_nowait((choice, False))

    async def _stop(self) -> None:
        # Cancelling a task closes its stream, which aborts its engine request.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def engine_error(e: EngineDeadError | EngineNotReadyError) -> APIError:
    if isinstance(e, EngineNotReadyError):
        return unavailable(f"No engine can take the request: {e}")
    return APIError(f"The engine serving this request failed: {e}", 500)


async def collect(runner: ChoiceRunner) -> list[Choice]:
    """Run every choice to its end (non-streaming responses)."""
    try:
        async with contextlib.aclosing(runner.updates()) as updates:
            async for choice in updates:
                if choice.done:
                    raise_if_failed(choice)
    except (EngineDeadError, EngineNotReadyError) as e:
        raise engine_error(e) from e
    return runner.choices


async def sse_events(
    runner: ChoiceRunner,
    chunk_for: Callable[[Choice], object],
    head: Sequence[object] = (),
    usage_chunk: Callable[[], object] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE body: ``head`` events, a chunk per update (when ``chunk_for``
    gives one), the usage chunk, then ``[DONE]``. Errors after the headers
    went out can only be told in the stream: an error event, then ``[DONE]``."""
    try:
        for event in head:
            yield sse(event)
        async with contextlib.aclosing(runner.updates()) as updates:
            async for choice in updates:
                raise_if_failed(choice)
                chunk = chunk_for(choice)
                if chunk is not None:
                    yield sse(chunk)
        if usage_chunk is not None:
            yield sse(usage_chunk())
    except (EngineDeadError, EngineNotReadyError) as e:
        err = engine_error(e)
        yield sse(error_body(err.message, err.status))
    except APIError as e:
        yield sse(error_body(e.message, e.status, e.param))
    except Exception:
        logger.exception("Unexpected error while streaming a response.")
        yield sse(error_body("Internal server error.", 500))
    yield DONE
