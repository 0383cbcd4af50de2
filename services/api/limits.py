"""What one client may ask of the server, and the middleware that caps request bodies.

``ServingLimits`` holds the API's hardening knobs (``weft serve`` flags).
Each bound turns a request that would cost without bound -- a huge body to
parse, a thousand choices, a prompt or output past any use, a million stop
strings, a body trickled in a byte a minute -- into a 400 (413 for the
body, 408 for the slow one) before any work is done.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.errors import APIError, bad_request, error_response
from services.processes import DEFAULT_SHUTDOWN_TIMEOUT_S

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_N = 16
DEFAULT_MAX_PROMPTS = 256
DEFAULT_MAX_PROMPT_CHARS = 1024 * 1024
DEFAULT_MAX_STOP = 64
DEFAULT_MAX_STOP_BYTES = 8192
DEFAULT_MAX_STOP_TOKEN_IDS = 256
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_MESSAGES = 4096
DEFAULT_MAX_TOOLS = 128  # OpenAI's own bound on a request's tools
DEFAULT_PAUSE_HOLD_TIMEOUT_S = 600.0
# n x prompt tokens x (top logprobs + 1), over a request's prompts: about 80 bytes of JSON each.
DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES = 65536
# Requests past the running batch wait in the engine's queue, as in vLLM; this
# many per rank at most (fewer where memory is short: fitting_waiting_requests).
DEFAULT_MAX_WAITING_REQUESTS = 1024
# The most one prompt token costs while its request waits: its id in the API's
# list (an 8-byte pointer and a 28-byte int), in the engine's decoded request
# and its two lists in the Request (three pointers and an int), and its share
# of the prefix-block hashes.
PROMPT_TOKEN_BYTES = 128
# Python's widest string takes 4 bytes a character.
BYTES_PER_CHAR = 4
# How deep a free-form JSON value (a schema) may nest: deeper ones would
# cost recursive walks (json.dumps, the schema checks) their stack.
MAX_JSON_DEPTH = 256


@dataclass(frozen=True)
class ServingLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body accepted (413 beyond)."""
    max_n: int = DEFAULT_MAX_N
    """Most choices (``n``) one request may ask for."""
    max_tokens: int | None = None
    """Largest ``max_tokens`` a request may ask for (None: up to max_model_len)."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (None: max_model_len - 1)."""
    max_waiting_requests: int | None = None
    """Engine requests that may wait per ready rank beyond the max_num_seqs it runs (None: 1024;
    ``weft serve`` lowers it where that many would not fit in memory)."""
    request_timeout_s: float | None = None
    """A request still running after this many seconds is aborted (None: never)."""
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    """On SIGTERM, how long in-flight requests may run before they are aborted."""
    max_prompts: int = DEFAULT_MAX_PROMPTS
    """Most prompts in one completions request (checked before tokenizing)."""
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    """Most characters of prompt text (or message contents) in one request (checked before tokenizing)."""
    max_stop: int = DEFAULT_MAX_STOP
    """Most stop strings in one request."""
    max_stop_bytes: int = DEFAULT_MAX_STOP_BYTES
    """Most UTF-8 bytes of all stop strings of one request together."""
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    """Most stop token ids in one request."""
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    """Longest time a request body may take to arrive (408 beyond)."""
    max_messages: int = DEFAULT_MAX_MESSAGES
    """Most chat messages (or Responses input items) in one request (checked before the chat template runs)."""
    max_tools: int = DEFAULT_MAX_TOOLS
    """Most tools in one request."""
    pause_hold_timeout_s: float | None = DEFAULT_PAUSE_HOLD_TIMEOUT_S
    """How long a request waits for a resume while generation is paused (then 503; None: for ever)."""
    max_prompt_logprob_entries: int = DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES
    """Most prompt logprob entries one request may ask for: n x prompt tokens x (prompt_logprobs + 1)."""

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_n",
            "max_tokens",
            "max_prompt_tokens",
            "max_prompts",
            "max_prompt_chars",
            "max_stop",
            "max_stop_bytes",
            "max_stop_token_ids",
            "max_messages",
            "max_tools",
            "max_prompt_logprob_entries",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be non-negative, got {self.max_waiting_requests}.")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}.")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be non-negative, got {self.shutdown_timeout_s}.")
        if self.pause_hold_timeout_s is not None and not self.pause_hold_timeout_s > 0:
            raise ValueError(f"pause_hold_timeout_s must be positive, got {self.pause_hold_timeout_s}.")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be positive, got {self.body_timeout_s}.")

    def waiting_per_rank(self) -> int:
        return (
            DEFAULT_MAX_WAITING_REQUESTS if self.max_waiting_requests is None else self.max_waiting_requests
        )

    def waiting_request_bytes(self, max_model_len: int) -> int:
        """The most memory one waiting engine request holds, API and engine together: the body
        it came in (kept until it is answered), its prompt text, and its prompt's token ids. Each
        engine request of an HTTP request (prompts x n) counts, so the largest is a lone one."""
        prompt_tokens = self.max_prompt_tokens or max_model_len - 1
        return (
            self.max_body_bytes + BYTES_PER_CHAR * self.max_prompt_chars + PROMPT_TOKEN_BYTES * prompt_tokens
        )

    def fitting_waiting_requests(self, max_model_len: int, num_ranks: int, memory_bytes: int) -> int:
        """``max_waiting_requests``' default: DEFAULT_MAX_WAITING_REQUESTS per rank, lowered
        so that every rank's waiting requests, each at its largest, fit in half of ``memory_bytes``."""
        fits = memory_bytes // 2 // (num_ranks * self.waiting_request_bytes(max_model_len))
        return min(DEFAULT_MAX_WAITING_REQUESTS, fits)

    def check_prompt_count(self, count: int, param: str = "prompt") -> None:
        if count > self.max_prompts:
            raise bad_request(
                f"The request has {count} prompts; this server takes at most "
                f"{self.max_prompts} (--max-prompts).",
                param,
            )

    def check_message_count(self, count: int, param: str = "messages", what: str = "messages") -> None:
        if count > self.max_messages:
            raise bad_request(
                f"The request has {count} {what}; this server takes at most "
                f"{self.max_messages} (--max-messages).",
                param,
            )

    def check_tool_count(self, count: int, param: str = "tools") -> None:
        if count > self.max_tools:
            raise bad_request(
                f"The request has {count} tools; this server takes at most {self.max_tools} (--max-tools).",
                param,
            )

    def check_text_size(self, texts: Iterable[str], param: str) -> None:
        """400 once the texts together pass ``max_prompt_chars`` (stops counting there)."""
        total = 0
        for text in texts:
            total += len(text)
            if total > self.max_prompt_chars:
                raise bad_request(
                    f"The {param} text is longer than this server takes "
                    f"({self.max_prompt_chars} characters, --max-prompt-chars).",
                    param,
                )

    def check_stop_lists(self, stop: str | list[str] | None, stop_token_ids: list[int] | None) -> None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop:
            raise bad_request(
                f"stop holds {len(stops)} strings; this server takes at most {self.max_stop} (--max-stop).",
                "stop",
            )
        size = sum(len(s.encode("utf-8", "surrogatepass")) for s in stops)
        if size > self.max_stop_bytes:
            raise bad_request(
                f"The stop strings are {size} bytes together; this server takes at most "
                f"{self.max_stop_bytes} (--max-stop-bytes).",
                "stop",
            )
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise bad_request(
                f"stop_token_ids holds {len(stop_token_ids)} ids; this server takes at most "
                f"{self.max_stop_token_ids} (--max-stop-token-ids).",
                "stop_token_ids",
            )


def add_cost_args(group: argparse._ActionsContainer) -> None:
    """The flags of the limits on what one request may cost the others."""
    group.add_argument(
        "--pause-hold-timeout",
        type=float,
        default=DEFAULT_PAUSE_HOLD_TIMEOUT_S,
        help="While generation is paused, seconds a new request waits for a resume before it gets "
        "503 (0: for ever; default: %(default)s).",
    )
    group.add_argument(
        "--max-prompt-logprob-entries",
        type=int,
        default=DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
        help="Most prompt logprob entries one request may ask for, n x prompt tokens x "
        "(prompt_logprobs + 1) over its prompts (400 beyond; default: %(default)s).",
    )


def available_memory_bytes() -> int:
    """Memory the system can give without swapping (Linux's MemAvailable; else all of it)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_depth(value: object, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """400 if the JSON value ``value`` nests deeper than ``limit``. Iterative,
    so no depth can exhaust the stack; each node is visited once."""
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        children: Iterable[object]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            raise bad_request(f"{param} nests deeper than this server accepts ({limit} levels).", param)
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


class _BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than this server accepts ({limit} bytes).", 413)


class BodySizeLimitMiddleware:
    """413 for a body over ``max_bytes``: at once when Content-Length says so,
    else as soon as the bytes read pass the limit (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = _BodyTooLarge(self.max_bytes)
            await error_response(error.message, error.status)(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)  # the app's error handler answers 413
            return message

        return counted


class _BodyTooSlow(APIError):
    def __init__(self, timeout_s: float) -> None:
        # Connection: close, so the server drops the rest of the body rather than wait for it.
        super().__init__(
            f"The request body did not arrive within {timeout_s:g} seconds.",
            408,
            headers={"Connection": "close"},
        )


class BodyDeadlineMiddleware:
    """408 for a body still arriving ``timeout_s`` after its request began,
    so that a client trickling bytes cannot hold a connection (and the
    request's slot) forever. Only the body's reads have the deadline: a
    response waiting on the client's disconnect afterwards waits as long as it needs."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, self._with_deadline(receive, time.monotonic() + self.timeout_s), send)

    def _with_deadline(self, receive: Receive, deadline: float) -> Receive:
        body_done = False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise _BodyTooSlow(self.timeout_s) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return receive_in_time
