"""The soak test's clients: random OpenAI requests, and what became of each.

Every request ends one of four ways, judged only from what the client saw:

- ``completed``: a 200 with every choice finished (a ``finish_reason``), and
  for streams the ``[DONE]`` event;
- ``error``: an OpenAI-shaped error -- an error status with an error body,
  or an error event then ``[DONE]`` in a stream -- its cause kept;
- ``disconnected``: the client itself hung up (on purpose, at random);
- ``lost``: anything else -- a connection cut, a stream that stopped without
  ``[DONE]``, a malformed body, no answer within the client timeout. A
  serving stack must never lose a request, whatever happens to its parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_MAX_RETRY_WAIT_S = 5.0
_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "List three colors:",
    "Translate to French: good morning",
    "The quick brown fox",
    "import numpy as np\n",
]


@dataclass
class RequestResult:
    endpoint: str
    stream: bool
    n: int
    start: float  # time.monotonic()
    end: float = 0.0
    outcome: str = "lost"  # completed | error | disconnected | lost
    cause: str = ""  # for errors and losses: why
    status: int = 0
    retry_after_s: float = 0.0  # what a 503 asked the client to wait


@dataclass(frozen=True)
class ClientParams:
    model: str
    max_tokens: int = 64
    disconnect_prob: float = 0.1
    timeout_s: float = 300.0


def random_body(rng: random.Random, params: ClientParams) -> tuple[str, dict[str, Any]]:
    """A valid request with random sampling parameters."""
    endpoint = rng.choice([COMPLETIONS, CHAT])
    body: dict[str, Any] = {
        "model": params.model,
        "max_tokens": rng.randint(1, params.max_tokens),
        "stream": rng.random() < 0.5,
        "n": rng.choice([1, 1, 1, 2]),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "top_p": rng.choice([1.0, 0.9]),
        "seed": rng.randint(0, 2**31),
        "ignore_eos": rng.random() < 0.5,
    }
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    prompt = rng.choice(_PROMPTS)
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 2
    else:
        body["prompt"] = prompt
        if rng.random() < 0.2:
            body["logprobs"] = 2
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return endpoint, body


async def run_one(http: httpx.AsyncClient, rng: random.Random, params: ClientParams) -> RequestResult:
    endpoint, body = random_body(rng, params)
    result = RequestResult(endpoint, body["stream"], body["n"], time.monotonic())
    # A client that leaves: after a few stream events, or after a short wait.
    leave_after = rng.randint(1, 8) if rng.random() < params.disconnect_prob else None
    try:
        if body["stream"]:
            await asyncio.wait_for(_stream(http, endpoint, body, result, leave_after), params.timeout_s)
        elif leave_after is not None:
            try:
                await asyncio.wait_for(_whole(http, endpoint, body, result), leave_after * 0.05)
            except TimeoutError:
                result.outcome, result.cause = "disconnected", "client left"
        else:
            await asyncio.wait_for(_whole(http, endpoint, body, result), params.timeout_s)
    except TimeoutError:
        result.outcome, result.cause = "lost", f"no answer in {params.timeout_s:.0f}s"
    except httpx.HTTPError as e:
        result.outcome, result.cause = "lost", f"transport: {type(e).__name__}: {e}"
    except ValueError as e:  # an SSE event that is not JSON
        result.outcome, result.cause = "lost", f"malformed stream event: {e}"
    result.end = time.monotonic()
    return result


async def _whole(http: httpx.AsyncClient, endpoint: str, body: dict, result: RequestResult) -> None:
    response = await http.post(endpoint, json=body)
    result.status = response.status_code
    result.retry_after_s = _retry_after(response)
    try:
        data = response.json()
    except ValueError:
        result.outcome, result.cause = "lost", f"{response.status_code} with a body that is not JSON"
        return
    if response.status_code == 200:
        finished = [c.get("finish_reason") for c in data.get("choices", [])]
        complete = len(finished) == body["n"] and all(finished)
        result.outcome = "completed" if complete else "lost"
        result.cause = "" if complete else f"200 with unfinished choices: {finished}"
    else:
        _error(result, data, response.status_code)


async def _stream(
    http: httpx.AsyncClient, endpoint: str, body: dict, result: RequestResult, leave_after: int | None
) -> None:
    finished: set[int] = set()
    error: dict | None = None
    async with http.stream("POST", endpoint, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.retry_after_s = _retry_after(response)
            await response.aread()
            try:
                _error(result, response.json(), response.status_code)
            except ValueError:
                result.outcome, result.cause = "lost", f"{response.status_code} with a body that is not JSON"
            return
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                _stream_end(result, body["n"], finished, error)
                return
            event = json.loads(data)
            if "error" in event:
                error = event
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    finished.add(choice["index"])
            events += 1
            if leave_after is not None and events >= leave_after:
                result.outcome, result.cause = "disconnected", "client left mid-stream"
                return
    result.outcome, result.cause = (
        "lost",
        f"stream ended without [DONE] after {len(finished)} finished choice(s)",
    )


def _retry_after(response: httpx.Response) -> float:
    try:
        return float(response.headers.get("retry-after", 0)) if response.status_code == 503 else 0.0
    except ValueError:
        return 0.0


def _stream_end(result: RequestResult, n: int, finished: set[int], error: dict | None) -> None:
    if error is not None:
        _error(result, error, error["error"].get("code", 0))
    elif len(finished) == n:
        result.outcome = "completed"
    else:
        result.outcome, result.cause = "lost", f"[DONE] with {len(finished)} of {n} choices finished"


def _error(result: RequestResult, data: Any, status: int) -> None:
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or not error.get("message"):
        result.outcome, result.cause = "lost", f"{status} without an OpenAI error body"
        return
    result.outcome, result.cause = "error", f"{status} {error_kind(error['message'])}"


def error_kind(message: str) -> str:
    """A short name for an error message, to count failures by cause."""
    for needle, kind in (
        ("stopped while serving", "engine core died"),
        ("overloaded", "overloaded"),
        ("No engine", "no engine ready"),
        ("shutting down", "shutting down"),
        ("timed out", "timed out"),
    ):
        if needle in message:
            return kind
    return message[:60]


@dataclass
class ClientPool:
    """``concurrency`` clients sending random requests back to back until stopped."""

    http: httpx.AsyncClient
    params: ClientParams
    concurrency: int
    seed: int = 0
    results: list[RequestResult] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.concurrency)))

    def stop(self) -> None:
        """No new requests; the ones in flight run to their end."""
        self._stop.set()

    async def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 10_007 + index)
        while not self._stop.is_set():
            result = await run_one(self.http, rng, self.params)
            self.results.append(result)
            if result.retry_after_s:  # a polite client waits as a 503 asks (not past the stop)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), min(result.retry_after_s, _MAX_RETRY_WAIT_S))
