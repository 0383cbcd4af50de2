"""The ``--api-key`` check: pure ASGI, on /v1 paths only.

/health, /metrics, /version, /tokenize and /detokenize stay open (vLLM does
the same: probes and scrapers carry no key). Keys are compared as SHA-256
digests with a constant-time compare, so neither the key's length nor its
prefix leaks through timing.
"""
from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.errors import error_response


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string.")
        self.app = app
        self._digest = _digest(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not _is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self._authorized(Headers(scope=scope).get("authorization", "")):
            await self.app(scope, receive, send)
            return
        response = error_response("Invalid or missing API key: send `Authorization: Bearer <key>`.", 401)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        # Always compare, even on a bad scheme, so every refusal costs the same.
        match = hmac.compare_digest(_digest(token.strip()), self._digest)
        return match and scheme.lower() == "bearer"
