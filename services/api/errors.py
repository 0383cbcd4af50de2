"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Routes raise ``APIError`` (``protocol/errors.py``, or one of the helpers here) for anything a client did
wrong or anything the engines cannot serve now; the app turns it into JSON
with the HTTP status as ``code``, the way vLLM does.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol.errors import APIError as APIError  # re-exported: routes raise it from here

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param)


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    """503: the client may try again after ``retry_after_s`` seconds."""
    return APIError(message, 503, headers={"Retry-After": str(retry_after_s)})


def error_body(message: str, status: int, param: str | None = None) -> dict[str, dict[str, object]]:
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def from_validation_error(e: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """A body that is not JSON, or not the right shape (msgspec names the path)."""
    if isinstance(e, msgspec.ValidationError):
        message = str(e)
        param = message.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in message else None
        return bad_request(f"Invalid request body: {message}", param)
    return bad_request(f"The body is not valid JSON: {e}")


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    response = error_response(exc.message, exc.status, exc.param)
    response.headers.update(exc.headers)
    return response


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    message = exc.detail if exc.status_code != 404 else f"Not found: {request.url.path}"
    return JSONResponse(
        error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers
    )


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this, so the server still logs the traceback.
    return error_response("Internal server error.", 500)
