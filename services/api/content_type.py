"""Every POST that carries a body must say ``Content-Type: application/json`` (415 otherwise).

A browser sends a cross-site POST without asking first (no CORS preflight)
only when its type is one of the "simple" ones (``text/plain``, form
encodings). Refusing those means a page on another site cannot make a
visitor's browser drive this server: it would need a preflight, which the
server does not grant. It also stops a body from being read as JSON when
its sender meant something else. Body-less POSTs (``/pause``,
``/reset_prefix_cache``) need no type.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.errors import error_response

JSON_MEDIA_TYPE = "application/json"


def _has_body(headers: Headers) -> bool:
    if "transfer-encoding" in headers:
        return True
    length = headers.get("content-length", "0").strip()
    return not (length.isdigit() and int(length) == 0)


class JSONContentTypeMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type == JSON_MEDIA_TYPE or not _has_body(headers):
            await self.app(scope, receive, send)
            return
        shown = media_type or "none"
        response = error_response(
            f"A request body must be JSON sent with `Content-Type: {JSON_MEDIA_TYPE}` (got {shown}).", 415
        )
        await response(scope, receive, send)
