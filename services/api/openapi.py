"""``/openapi.json`` (OpenAPI 3.1) and ``/docs`` (Swagger UI), made from the app's own routes.

Every route of the app is listed, with the msgspec Structs that decode its body and shape
its answer as JSON Schemas (``msgspec.json.schema_components``: JSON Schema 2020-12, which
is OpenAPI 3.1's dialect). A route with no Struct of its own answers a JSON object (or
Prometheus text, SSE) described in words. Built once, on the first request, off the loop.
Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from services.api.openai_schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    TokenizeRequest,
)
from services.api.responses_schemas import ResponsesRequest

_REF = "#/components/schemas/{name}"
# path -> (request body Struct, response Struct); None where it is free-form.
_BODIES: dict[str, tuple[type | None, type | None]] = {
    "/v1/completions": (CompletionRequest, CompletionResponse),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
    "/v1/responses": (ResponsesRequest, None),
    "/v1/embeddings": (EmbeddingRequest, EmbeddingResponse),
    "/tokenize": (TokenizeRequest, None),
    "/detokenize": (DetokenizeRequest, None),
}
_STREAMING = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
_TEXT_ROUTES = {"/metrics": "text/plain", "/docs": "text/html"}
_SUMMARIES = {
    "/v1/completions": "Create a completion (OpenAI).",
    "/v1/chat/completions": "Create a chat completion (OpenAI).",
    "/v1/responses": "Create a response (OpenAI Responses API).",
    "/v1/responses/{response_id}": "A stored response.",
    "/v1/embeddings": "Create embeddings (OpenAI).",
    "/v1/models": "The served models (OpenAI).",
    "/v1/models/{model}": "One served model (OpenAI).",
    "/health": "Readiness: 200 when every engine core is ready, else 503.",
    "/ping": "Liveness: 200 while the process serves.",
    "/version": "weft's version.",
    "/tokenize": "Token ids of a prompt or of chat messages.",
    "/detokenize": "Text of token ids.",
    "/metrics": "Prometheus metrics (vLLM's families).",
    "/openapi.json": "This document.",
    "/docs": "Swagger UI over this document.",
}
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
            "required": ["message", "type", "code"],
        }
    },
    "required": ["error"],
}


def openapi_document(routes: list[Route], version: str, root_path: str = "") -> dict[str, Any]:
    structs = sorted(
        {t for pair in _BODIES.values() for t in pair if t is not None}, key=lambda t: t.__name__
    )
    refs, components = msgspec.json.schema_components(structs, ref_template=_REF)
    ref_of = {t: ref for t, ref in zip(structs, refs)}
    components["ErrorResponse"] = _ERROR
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        path = route.path.replace("{model:path}", "{model}")
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = _operation(path, method, ref_of)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "weft", "version": version, "description": "An OpenAI-compatible LLM server."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    if root_path:
        document["servers"] = [{"url": root_path}]
    return document


def _operation(path: str, method: str, ref_of: dict[type, dict[str, Any]]) -> dict[str, Any]:
    request_type, response_type = _BODIES.get(path, (None, None)) if method == "POST" else (None, None)
    content: dict[str, Any]
    if path in _TEXT_ROUTES:
        content = {_TEXT_ROUTES[path]: {"schema": {"type": "string"}}}
    else:
        schema = ref_of[response_type] if response_type is not None else {"type": "object"}
        content = {"application/json": {"schema": schema}}
        if path in _STREAMING and method == "POST":
            content["text/event-stream"] = {"schema": {"type": "string"}}
    operation: dict[str, Any] = {
        "summary": _SUMMARIES.get(path, f"{method} {path}"),
        "operationId": f"{method.lower()}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
        "responses": {
            "200": {"description": "OK", "content": content},
            "default": {
                "description": "An error, OpenAI-shaped.",
                "content": {"application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}},
            },
        },
    }
    if request_type is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref_of[request_type]}},
        }
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _path_parameters(path)
    ]
    if parameters:
        operation["parameters"] = parameters
    if path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/pause", "/resume"):
        operation["security"] = [{"bearer": []}, {}]  # a key when the server has --api-key
    return operation


def _path_parameters(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


_DOCS = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>weft API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css">
</head><body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: %s, dom_id: "#swagger-ui"});</script>
</body></html>
"""


class OpenAPIRoutes:
    """``/openapi.json`` and ``/docs``; ``routes`` is read when first asked (the app's final table)."""

    def __init__(self, routes: list[Route], version: str, root_path: str = "") -> None:
        self._routes = routes
        self._version = version
        self._root_path = root_path
        self._body: bytes | None = None

    async def openapi(self, request: Request) -> Response:
        if self._body is None:
            document = openapi_document(self._routes, self._version, self._root_path)
            self._body = json.dumps(document).encode()
        return Response(self._body, media_type="application/json")

    async def docs(self, request: Request) -> Response:
        # The root path is checked to be a plain path (operator_options.check_root_path).
        return HTMLResponse(_DOCS % json.dumps(f"{self._root_path}/openapi.json"))

    def table(self) -> list[Route]:
        return [
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/docs", self.docs, methods=["GET"]),
        ]


async def ping(request: Request) -> Response:
    """Liveness: this process serves HTTP, whatever its engines do (readiness is /health)."""
    return JSONResponse({"status": "alive"})
