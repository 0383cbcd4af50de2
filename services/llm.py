"""The offline entry point: ``LLM(...).generate(prompts, sampling_params)``, and
``LLM(...).embed(prompts)`` for embeddings (pooled as ``--pooler`` says).

Runs an EngineCore in-process and steps it until every request finished,
doing the front end's part itself (tokenize, detokenize, stop strings).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol import EngineCoreRequest, PoolingParams, PoolingType, SamplingParams
from services.api.output_processor import Logprob, RequestState
from services.api.tokenizer import Tokenizer
from services.config.engine_args import EngineArgs
from services.engine_core.core import EngineCore
from services.generation_config import with_extra_eos

Prompt = str | list[int] | dict


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # L2-normalized, hidden_size long


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class LLM:
    """An engine in this process. ``model=None`` loads the default model."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineArgs.from_kwargs(model=model, **engine_args).create_engine_config()
        self.tokenizer = Tokenizer(self.config.model.tokenizer)
        self.engine = EngineCore(self.config)
        self.config = self.engine.config  # with the context its KV cache holds
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        extra_eos = self.config.model.extra_eos_token_ids
        params = [with_extra_eos(p, extra_eos) for p in _match_params(sampling_params, len(prompts))]
        # Tokenize and validate everything first: a bad prompt fails the call
        # before any request reaches the engine.
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
        states = self._run(requests, use_tqdm)
        return [_request_output(p, children, states) for p, children in zip(prompts, requests)]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: its hidden states pooled as ``pooling_params`` say, by
        default as the engine's pooler does (``ModelConfig.pooler``), L2-normalized."""
        pooling = pooling_params or PoolingParams(PoolingType(self.config.model.pooler))
        requests = []
        for prompt in _as_prompt_list(prompts):
            request = EngineCoreRequest(
                request_id=f"{next(self._ids)}-0",
                prompt_token_ids=self._token_ids(prompt),
                sampling_params=SamplingParams(max_tokens=1),
                arrival_time=time.time(),
                pooling_params=pooling,
            )
            self.engine.validate_request(request)
            requests.append([request])
        states = self._run(requests, use_tqdm)
        outputs = []
        for (request,) in requests:
            state = states[request.request_id]
            if state.pooled is None:
                raise RuntimeError(f"Request {request.request_id} ended without an embedding: {state.error}")
            outputs.append(
                EmbeddingRequestOutput(
                    request.request_id.rsplit("-", 1)[0],
                    request.prompt_token_ids,
                    EmbeddingOutput(state.pooled.tolist()),
                )
            )
        return outputs

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (as vLLM's LLM)."""
        return SamplingParams(**self.config.model.generation_defaults)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        # The template already holds the special tokens.
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False), "prompt": t}
            for t in texts
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> list[EngineCoreRequest]:
        token_ids = self._token_ids(prompt)
        parent_id = str(next(self._ids))
        children = []
        for index in range(params.n):
            child = msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index
            )
            request = EngineCoreRequest(
                request_id=f"{parent_id}-{index}",
                prompt_token_ids=token_ids,
                sampling_params=child,
                arrival_time=time.time(),
                eos_token_id=self.tokenizer.eos_token_id,
            )
            self.engine.validate_request(request)
            children.append(request)
        return children

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _run(self, requests: list[list[EngineCoreRequest]], use_tqdm: bool) -> dict[str, RequestState]:
        """Step the engine until every request finished; each request's state by its id."""
        states: dict[str, RequestState] = {}
        for children in requests:
            for request in children:
                states[request.request_id] = RequestState.create(
                    request.request_id, request.sampling_params, self.tokenizer, request.eos_token_id
                )
                self.engine.add_request(request)
        progress = _progress(len(requests), use_tqdm)
        pending = {children[0].request_id.rsplit("-", 1)[0]: len(children) for children in requests}
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step().outputs:
                    state = states[output.request_id]
                    if state.process(output):
                        self.engine.abort_requests([output.request_id])
                    if state.finished:
                        parent = output.request_id.rsplit("-", 1)[0]
                        pending[parent] -= 1
                        progress.update(pending[parent] == 0)
        except BaseException:
            self.engine.abort_requests(list(states))
            raise
        finally:
            progress.close()
        return states

    def shutdown(self) -> None:
        self.engine.shutdown()


def _request_output(
    prompt: Prompt, children: list[EngineCoreRequest], states: dict[str, RequestState]
) -> RequestOutput:
    child_states = [states[c.request_id] for c in children]
    first = child_states[0]
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return RequestOutput(
        request_id=children[0].request_id.rsplit("-", 1)[0],
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=children[0].prompt_token_ids,
        prompt_logprobs=first.prompt_logprobs,
        outputs=[
            CompletionOutput(
                index=i,
                text=s.text,
                token_ids=s.token_ids,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                error=s.error,
            )
            for i, s in enumerate(child_states)
        ],
        finished=all(s.finished for s in child_states),
        num_cached_tokens=first.num_cached_tokens,
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("No prompts given.")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _match_params(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(
            f"Got {len(params)} sampling params for {count} prompts; give one for all, or one per prompt."
        )
    return params


class _NoProgress:
    def update(self, n: int = 1) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
