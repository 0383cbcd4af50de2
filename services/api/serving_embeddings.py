"""POST /v1/embeddings: inputs in, one pooled, L2-normalized vector per input out.

Each input is one prompt-only engine request (``EngineCoreRequest.pooling_params``):
the engine prefills it, samples nothing, and answers with its pooled hidden
state (``--pooler``). Inputs take completions' four prompt shapes and its
limits. ``encoding_format=base64`` sends each vector as base64 of its
little-endian float32 bytes, as OpenAI does (the official SDK asks for it by
default). ``dimensions`` is honoured only at the model's own width: a model
without Matryoshka training has no shorter embedding worth returning.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from protocol import EngineCoreRequest, PoolingParams, PoolingType, SamplingParams
from services.api import serving
from services.api.errors import bad_request
from services.api.metrics import RequestMetrics
from services.api.offload import run_blocking
from services.api.openai_schemas import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    encode,
)
from services.api.output_processor import RequestState
from services.api.serving import Choice, ServingContext
from services.api.serving_completions import check_prompt_size, prompt_token_lists
from services.api.streaming import unless_disconnected

_PARAM = "input"
# Unused by the engine for a pooling request; a valid value the request must still carry.
_NO_SAMPLING = SamplingParams(max_tokens=1)


class EmbeddingServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.pooling = PoolingParams(PoolingType(ctx.config.model.pooler))

    async def create(self, request: Request, body: EmbeddingRequest) -> Response:
        arrival = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        check_dimensions(body.dimensions, ctx.config.model.hidden_size)
        check_prompt_size(ctx, body.input, _PARAM)  # before tokenizing
        prompts = await run_blocking(prompt_token_lists, ctx, body.input, body.add_special_tokens, _PARAM)
        ctx.check_num_sequences(len(prompts), 1, _PARAM)
        for prompt in prompts:
            serving.check_prompt_ids(ctx, prompt, _PARAM, prompt_only=True)
        request_id = serving.new_request_id("embd", request)
        key = serving.session_key(request, body)
        ids = serving.engine_request_ids(request_id, len(prompts))
        choices = [self._choice(ids[i], i, prompt, arrival, key) for i, prompt in enumerate(prompts)]
        runner = ctx.admit(request, choices)  # 503 + Retry-After when the engines are full
        await unless_disconnected(request, serving.collect(runner))
        # Up to max_prompts vectors to format: off the event loop.
        body_bytes = await run_blocking(
            _encode_response, choices, ctx.served_model_name, body.encoding_format
        )
        return Response(body_bytes, media_type="application/json")

    def _choice(
        self, engine_request_id: str, index: int, prompt: list[int], arrival: float, key: str | None
    ) -> Choice:
        ctx = self.ctx
        engine_request = EngineCoreRequest(
            request_id=engine_request_id,
            prompt_token_ids=prompt,
            sampling_params=_NO_SAMPLING,
            arrival_time=time.time(),
            session_key=key,
            pooling_params=self.pooling,
        )
        state = RequestState.create(engine_request.request_id, _NO_SAMPLING, ctx.tokenizer)
        metrics: RequestMetrics = ctx.metrics.request(len(prompt), arrival)
        return Choice(index, index, engine_request, state, metrics)


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is not None and dimensions != hidden_size:
        raise bad_request(
            f"dimensions must be this model's embedding size ({hidden_size}) or left out: "
            f"it was not trained to give shorter (Matryoshka) embeddings; got {dimensions}.",
            "dimensions",
        )


def _encode_response(choices: list[Choice], model: str, encoding_format: str) -> bytes:
    data = []
    for choice in choices:
        vector = choice.state.pooled
        if vector is None:
            raise RuntimeError(f"Engine request {choice.request.request_id} finished without an embedding.")
        data.append(EmbeddingData(index=choice.index, embedding=_format(vector, encoding_format)))
    num_tokens = sum(choice.num_prompt_tokens for choice in choices)
    return encode(EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(num_tokens, num_tokens)))


def _format(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    values: list[float] = vector.tolist()
    return values
