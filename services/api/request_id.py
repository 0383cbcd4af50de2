"""``X-Request-Id``: the id of each HTTP exchange, the client's or a new one.

A client (or a proxy in front) may send ``X-Request-Id``; weft then uses it as the request's
id: the completion's ``id`` (``cmpl-ID``, ``chatcmpl-ID``, ``embd-ID``; a stored Responses
API response keeps a random one), the engine requests (``cmpl-ID-NONCE-0``, ...: unique even
when two clients send the same id), and
``request_id`` in JSON log lines. Without one, weft makes a random one. Either way the
response carries it back in ``X-Request-Id``. An id that is empty, longer than
``MAX_REQUEST_ID_CHARS`` or holds a character outside ``A-Z a-z 0-9 . _ : -`` is refused
with a 400 naming the header, so that what lands in logs and ids is always safe to print
and to put in a URL. Pure ASGI, torch-free.
"""

from __future__ import annotations

import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.log_format import current_request_id

HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_VALID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def request_id_of(scope: Scope) -> str | None:
    """The id the middleware gave this exchange (None outside it, as in unit tests)."""
    request_id: str | None = scope.get("state", {}).get("request_id")
    return request_id


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER)
        if given is not None and not _VALID.fullmatch(given):
            response = JSONResponse(
                {
                    "error": {
                        "message": f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} characters of "
                        "A-Z, a-z, 0-9, '.', '_', ':' and '-'.",
                        "type": "BadRequestError",
                        "param": "X-Request-Id",
                        "code": 400,
                    }
                },
                status_code=400,
            )
            await response(scope, receive, send)
            return
        request_id = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)
