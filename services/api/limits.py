"""What one client may ask of the server, and the middleware that caps request bodies.

``ServingLimits`` holds the API's hardening knobs (``weft serve`` flags).
Each bound turns a request that would cost without bound -- a huge body to
parse, a thousand choices, a prompt or output past any use -- into a 400
(413 for the body) before any work is done.
"""
from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_N = 16
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


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
    """Engine requests that may wait per ready rank beyond the max_num_seqs it runs (None: 2 x max_num_seqs)."""
    request_timeout_s: float | None = None
    """A request still running after this many seconds is aborted (None: never)."""
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    """On SIGTERM, how long in-flight requests may run before they are aborted."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_tokens", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be non-negative, got {self.max_waiting_requests}.")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}.")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be non-negative, got {self.shutdown_timeout_s}.")

    def waiting_per_rank(self, max_num_seqs: int) -> int:
        return 2 * max_num_seqs if self.max_waiting_requests is None else self.max_waiting_requests


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
