"""Requests for the tests that drive DPLBEngineClient against real engine cores."""

from __future__ import annotations

import time

from protocol import EngineCoreRequest, SamplingParams
from services.api.dp_client import DPLBEngineClient


def make_request(
    request_id: str, max_tokens: int = 4, prompt_len: int = 8, first_token: int = 200
) -> EngineCoreRequest:
    """Greedy, ``ignore_eos``: exactly ``max_tokens`` come back."""
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + prompt_len)),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        arrival_time=time.time(),
    )


async def collect(client: DPLBEngineClient, request: EngineCoreRequest):
    """(every new token, the last output) of one request."""
    tokens, last = [], None
    async for output in client.generate(request):
        tokens += output.new_token_ids
        last = output
    return tokens, last
