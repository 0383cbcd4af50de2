"""An in-process EngineClient that "generates" a fixed script of tokens.

The app's tests plug it into ``build_app``: it records every request,
abort and early close, and can be told to die, hang or fail a request.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator

import httpx
import openai

from protocol import (
    EngineConfig,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    ModelConfig,
    SchedulerConfig,
    TokenLogprobs,
)
from protocol.engine import UtilityMethod
from services import model_files
from services.api.app import build_app
from services.api.engine_client import EngineClient, EngineDeadError, EngineNotReadyError, RankStats
from services.api.tokenizer import Tokenizer

SCRIPT = "Hello world! The quick brown fox jumps over the lazy dog. STOP here, then more text."
MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256


@functools.lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    return Tokenizer(model_files.resolve(None).hf_dir)


def engine_config(max_model_len: int = MAX_MODEL_LEN, policy: str = "fcfs") -> EngineConfig:
    tok = tokenizer()
    model = ModelConfig(
        model="models/SmolLM2-135M-Instruct.Q4_1.gguf",
        tokenizer="models",
        served_model_name=MODEL_NAME,
        dtype="float32",
        max_model_len=max_model_len,
        vocab_size=tok.vocab_size,
        eos_token_id=tok.eos_token_id,
    )
    return EngineConfig(model=model, scheduler=SchedulerConfig(scheduling_policy=policy))


class FakeEngineClient(EngineClient):
    def __init__(self, num_ranks: int = 1) -> None:
        self.script = tokenizer().encode(SCRIPT, add_special_tokens=False)
        self.ranks = {r: RankStats(rank=r, state="ready") for r in range(num_ranks)}
        self.requests: list[EngineCoreRequest] = []
        self.aborted: set[str] = set()
        self.closed_early: set[str] = set()  # iterators closed before their last output
        self.num_aborts = 0  # abort() ids plus early closes: exactly one per aborted request
        self.started = self.shut_down = False
        self.die_after: int | None = None  # raise EngineDeadError after this many outputs
        self.hang_after: int | None = None  # wait forever (until cancelled) after this many
        self.fail_with: str | None = None  # finish every request with FinishReason.ERROR
        self.fail_internally = False  # ... marked as the engine's fault (a 500), not the input's
        self.num_cached_tokens = 0
        self.cached_tokens_by_index: dict[int, int] = {}  # child index -> its own prefix hit
        self.burst = False  # yield all outputs without letting the loop run in between
        self.hanging = asyncio.Event()  # set when a request starts hanging
        self.utility_calls: list[UtilityMethod] = []
        self.reset_refused = False  # reset_prefix_cache answers False, as with KV blocks in use
        self.stops_at_eos = False  # finish at the request's EOS token, as an engine does

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True

    @property
    def ready(self) -> bool:
        return all(s.state == "ready" for s in self.ranks.values())

    def rank_stats(self) -> dict[int, RankStats]:
        return self.ranks

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.update(request_ids)
        self.num_aborts += len(request_ids)

    async def call_utility(self, method: UtilityMethod) -> dict[int, bool]:
        self.utility_calls.append(method)
        ok = not (method is UtilityMethod.RESET_PREFIX_CACHE and self.reset_refused)
        return {rank: ok for rank in self.ranks}

    def token_at(self, request: EngineCoreRequest, step: int) -> int:
        offset = request.sampling_params.seed or 0
        return self.script[(step + offset) % len(self.script)]

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        if not any(s.state == "ready" for s in self.ranks.values()):
            raise EngineNotReadyError("no rank is ready")
        self.requests.append(request)
        finished = False
        try:
            max_tokens = request.sampling_params.max_tokens
            for step in range(max_tokens):
                await self._maybe_misbehave(step)
                output = self._output(request, step, last=step == max_tokens - 1)
                finished = output.finished
                yield output
                if finished:
                    return
                if not self.burst:
                    await asyncio.sleep(0)  # let the other requests take turns
        finally:
            if not finished:
                # As DPLBEngineClient's generator: closing it early is the abort.
                self.closed_early.add(request.request_id)
                self.aborted.add(request.request_id)
                self.num_aborts += 1

    async def _maybe_misbehave(self, step: int) -> None:
        if self.die_after is not None and step >= self.die_after:
            raise EngineDeadError("engine core 0 died")
        if self.hang_after is not None and step >= self.hang_after:
            self.hanging.set()
            await asyncio.Event().wait()  # nobody sets it: only cancellation ends this

    def _output(self, request: EngineCoreRequest, step: int, last: bool) -> EngineCoreOutput:
        params = request.sampling_params
        token = self.token_at(request, step)
        index = int(request.request_id.rsplit("-", 1)[1])
        cached = self.cached_tokens_by_index.get(index, self.num_cached_tokens)
        # Engine clock: scheduled at 100.25, first token at 100.5, then one every 0.125.
        output = EngineCoreOutput(
            request.request_id, [token], num_cached_tokens=cached, timestamp=100.5 + 0.125 * step
        )
        if step == 0:
            output.events = [
                EngineCoreEvent(EngineCoreEventType.QUEUED, 100.0),
                EngineCoreEvent(EngineCoreEventType.SCHEDULED, 100.25),
            ]
            if params.prompt_logprobs is not None:
                # Position p's entry: the prompt token first (logprob -p), then the script's.
                output.new_prompt_logprobs = [None] + [
                    TokenLogprobs(
                        [t, *self.script[: params.prompt_logprobs]],
                        [-float(p)] + [-0.25] * params.prompt_logprobs,
                        rank=p,
                    )
                    for p, t in enumerate(request.prompt_token_ids[1:], 1)
                ]
        if params.logprobs is not None:
            # The chosen token is the most likely one; the top-k follow it.
            top = ([token] + [t for t in self.script if t != token])[: params.logprobs]
            output.new_logprobs = [
                TokenLogprobs([token] + top, [-0.5] + [-0.5 - i for i in range(len(top))], rank=1)
            ]
        if self.fail_with is not None:
            output.finish_reason, output.error = FinishReason.ERROR, self.fail_with
            output.error_is_internal = self.fail_internally
        elif params.stop_token_ids and token in params.stop_token_ids:
            output.finish_reason, output.stop_reason = FinishReason.STOP, token
        elif self.stops_at_eos and token == request.eos_token_id and not params.ignore_eos:
            output.finish_reason = FinishReason.STOP
        elif last:
            output.finish_reason = FinishReason.LENGTH
        return output


def make_app(engine: FakeEngineClient | None = None, **kwargs):
    engine = engine or FakeEngineClient()
    config = kwargs.pop("config", None) or engine_config()
    return build_app(engine, tokenizer(), config, **kwargs), engine


def http_client(app, **kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", **kwargs)


def openai_client(app, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key=api_key, max_retries=0, http_client=http_client(app)
    )
