"""Server-sent events, and noticing a client that went away.

Both paths watch the ASGI receive channel for ``http.disconnect``: a client
that leaves mid-stream or while waiting for a whole JSON body cancels the
work, and cancelling the work closes the engine streams, which aborts the
engine requests (their KV blocks go back to the pool).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.api.api_options import APIOptions
from services.api.errors import bad_request
from services.api.openai_schemas import SamplingFields, encode

logger = logging.getLogger(__name__)

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


def check_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")


def usage_modes(options: APIOptions, body: SamplingFields) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage on every chunk), as vLLM decides them: the
    server flag forces the first; continuous usage needs include_usage."""
    asked = body.stream_options
    include = options.enable_force_include_usage or (asked is not None and asked.include_usage)
    return include, include and asked is not None and asked.continuous_usage_stats


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_or_disconnect(work: Awaitable[T], receive: Receive) -> T:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (call
    after the body was read, so the next ASGI message is the disconnect)."""
    return await _first_or_disconnect(work, request.receive)


class SSEResponse(StreamingResponse):
    """A stream of ``data:`` events that stops, and closes its source, when
    the client leaves, whatever ASGI spec version the server speaks."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _first_or_disconnect(self.stream_response(send), receive)
        except (ClientDisconnected, OSError):
            logger.debug("Client disconnected mid-stream; its requests are aborted.")
        finally:
            close = getattr(self._events, "aclose", None)
            if close is not None:
                await close()
