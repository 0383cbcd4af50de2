"""The error a request gets over HTTP: a message, its status, the field at fault.

``services/api/errors.py`` turns one into OpenAI's JSON shape
(``{"error": {"message", "type", "param", "code"}}``); it lives here so that
the parts below the API that judge a request (``services/kv_transfer/trust.py``)
raise it without importing the API. Stdlib only.
"""

from __future__ import annotations


class APIError(Exception):
    def __init__(
        self, message: str, status: int = 400, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}
