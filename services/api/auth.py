"""The ``--api-key`` check: pure ASGI, on /v1 paths, /tokenize and /detokenize.

/health, /metrics and /version stay open (vLLM does the same: probes and
scrapers carry no key). /tokenize and /detokenize cost CPU and show how a
prompt tokenizes, so they are protected unless ``protect_tokenize`` is
off (``--no-api-key-protects-tokenize``); ``also_protect`` names more exact
paths that need a key. Several
keys may be valid at
once (to rotate them). Keys are compared as SHA-256 digests with a
constant-time compare, against every key each time, so neither a key's
length, its prefix nor which key matched leaks through timing. The key's
digest names the request's tenant (``tenant_of``): the Responses store
keeps each key's responses apart.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.errors import error_response


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


# Where the middleware notes who a request's key belongs to (``tenant_of``).
TENANT_STATE = "weft_tenant"
_TOKENIZER_ROUTES = frozenset({"/tokenize", "/detokenize"})


def _is_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class APIKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_keys: str | Sequence[str],
        protect_tokenize: bool = True,
        also_protect: Sequence[str] = (),
    ) -> None:
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
        if not keys or not all(keys):
            raise ValueError("API keys must be non-empty strings.")
        self.app = app
        self._digests = [_digest(key) for key in keys]
        self._protect_tokenize = protect_tokenize
        self._also_protected = frozenset(also_protect)

    def _is_protected(self, path: str) -> bool:
        return (
            _is_v1(path)
            or path in self._also_protected
            or (self._protect_tokenize and path.rstrip("/") in _TOKENIZER_ROUTES)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(Headers(scope=scope).get("authorization", ""))
        if tenant is not None:
            scope.setdefault("state", {})[TENANT_STATE] = tenant
            await self.app(scope, receive, send)
            return
        response = error_response("Invalid or missing API key: send `Authorization: Bearer <key>`.", 401)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _tenant(self, header: str) -> str | None:
        """Who the key's holder is (its digest, in hex), or None for a missing or wrong key."""
        return bearer_match(header, self._digests)


def key_digests(keys: Sequence[str]) -> list[bytes]:
    return [_digest(key) for key in keys]


def bearer_match(header: str, digests: Sequence[bytes]) -> str | None:
    """The digest (hex) of the ``Authorization: Bearer`` key when it is one of ``digests``, else None."""
    scheme, _, token = header.partition(" ")
    # Always compare with every key, even on a bad scheme, so every
    # answer costs the same.
    digest = _digest(token.strip())
    matches = [hmac.compare_digest(digest, known) for known in digests]
    return digest.hex() if any(matches) and scheme.lower() == "bearer" else None


def tenant_of(scope: Scope) -> str:
    """The tenant a request was made as: its API key's digest, or "" on a server without keys."""
    tenant: str = scope.get("state", {}).get(TENANT_STATE, "")
    return tenant
