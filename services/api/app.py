"""The OpenAI-compatible HTTP app.

``build_app`` wires the routes to an ``EngineClient`` (the real balancer in
``weft serve``, a fake in tests). Every client error leaves as an
OpenAI-shaped JSON error, never a stack trace; a client that disconnects
gets its engine requests aborted. ``ServingLimits`` bound what a request may
ask; admission control (``services.api.admission``) answers 503 with
Retry-After when the engines' queues are full, and ``app.state.admission``
is what a graceful shutdown drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol import EngineConfig
from services.api.admission import Admission, TicketReleaseMiddleware
from services.api.api_options import APIOptions
from services.api.auth import APIKeyMiddleware
from services.api.chat_args import ChatSettings
from services.api.content_type import JSONContentTypeMiddleware
from services.api.engine_client import EngineClient
from services.api.errors import (
    APIError,
    api_error_handler,
    bad_request,
    http_error_handler,
    internal_error_handler,
)
from services.api.limits import BodyDeadlineMiddleware, BodySizeLimitMiddleware, ServingLimits, check_depth
from services.api.management import ManagementRoutes
from services.api.metrics import CONTENT_TYPE, APIMetrics
from services.api.offload import run_blocking
from services.api.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from services.api.openapi import OpenAPIRoutes, ping
from services.api.operator_options import OperatorOptions, operator_middleware
from services.api.pausable import PausableEngineClient
from services.api.reliability_metrics import ReliabilityCollector
from services.api.responses_schemas import ResponsesRequest
from services.api.responses_store import ResponsesStore
from services.api.serving import ServingContext
from services.api.serving_chat import ChatServing, check_messages_size, render_prompt_ids
from services.api.serving_completions import CompletionServing
from services.api.serving_embeddings import EmbeddingServing
from services.api.serving_responses import ResponsesServing
from services.api.streaming import ClientDisconnected
from services.api.tokenizer import Tokenizer
from services.api.tracing import start_tracer
from services.api.unknown_fields import decode_request

# What a server answers to a request whose client is gone (nginx's code); nobody reads it.
_CLIENT_CLOSED = 499
S = TypeVar("S", bound=msgspec.Struct)


def _version() -> str:
    try:
        return importlib.metadata.version("weft")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def _read(request: Request, type: type[S], allow_unknown: bool = False) -> S:
    """The body as ``type`` (unknown fields: see ``decode_request``), every nesting bounded."""
    try:
        body = decode_request(await request.body(), type, allow_unknown)
    except RecursionError:
        # msgspec stops at its own depth limit, in any field, known or not.
        raise bad_request("The request body nests too deeply.") from None
    _check_free_form_depth(body)
    return body


def _check_free_form_depth(body: object) -> None:
    """Schemas are free-form JSON (or JSON text) that later code walks
    recursively: bound their depth first."""
    _check_schema_depth(getattr(body, "guided_json", None), "guided_json")
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        _check_schema_depth(structured.json, "structured_outputs")
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.json_schema is not None:
        _check_schema_depth(response_format.json_schema.schema, "response_format")
    text = getattr(body, "text", None)
    if text is not None and not isinstance(text, str) and text.format is not None:
        _check_schema_depth(text.format.schema, "text")


def _check_schema_depth(schema: object, param: str) -> None:
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)  # in C, with its own depth limit
        except RecursionError:
            raise bad_request(f"{param} nests too deeply.", param) from None
        except msgspec.DecodeError:
            return  # not JSON: the schema's own check names that
    check_depth(schema, param)


def _client_may_leave(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A client gone before the response is ready gets nothing, not a 500."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except (ClientDisconnected, ClientDisconnect):
            return Response(status_code=_CLIENT_CLOSED)

    return endpoint


class _Routes:
    def __init__(
        self, ctx: ServingContext, chat: ChatSettings | None = None, store: ResponsesStore | None = None
    ) -> None:
        self.ctx = ctx
        self.completions = CompletionServing(ctx)
        self.chat = ChatServing(ctx, chat)
        self.responses = ResponsesServing(self.chat, store if store is not None else ResponsesStore())
        self.embeddings = EmbeddingServing(ctx)
        self.created = int(time.time())

    async def create_completion(self, request: Request) -> Response:
        body = await _read(request, CompletionRequest, self.ctx.options.allow_unknown_fields)
        return await self.completions.create(request, body)

    async def create_chat_completion(self, request: Request) -> Response:
        body = await _read(request, ChatCompletionRequest, self.ctx.options.allow_unknown_fields)
        return await self.chat.create(request, body)

    async def create_response(self, request: Request) -> Response:
        body = await _read(request, ResponsesRequest, self.ctx.options.allow_unknown_fields)
        return await self.responses.create(request, body)

    async def retrieve_response(self, request: Request) -> Response:
        return await self.responses.retrieve(request, request.path_params["response_id"])

    async def delete_response(self, request: Request) -> Response:
        return await self.responses.delete(request, request.path_params["response_id"])

    async def create_embedding(self, request: Request) -> Response:
        body = await _read(request, EmbeddingRequest, self.ctx.options.allow_unknown_fields)
        return await self.embeddings.create(request, body)

    def model_card(self, name: str) -> dict[str, object] | None:
        """The card of a served name (the first of --served-model-name, or an alias); None if not served."""
        if name != self.ctx.served_model_name and name not in self.ctx.model_aliases:
            return None
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "weft",
            "root": self.ctx.served_model_name,
            "parent": None,
            "max_model_len": self.ctx.max_model_len,
            "permission": [],
        }

    async def models(self, request: Request) -> Response:
        names = [self.ctx.served_model_name, *self.ctx.model_aliases]
        return JSONResponse({"object": "list", "data": [self.model_card(name) for name in names]})

    async def health(self, request: Request) -> Response:
        """200 only when every rank is ready; otherwise 503, "degraded" when
        some rank died but others still serve. Per-rank load rides along."""
        client = self.ctx.engine_client
        by_state: dict[str, list[int]] = {"ready": [], "waiting": [], "dead": []}
        ranks = []
        for rank, stats in sorted(client.rank_stats().items()):
            by_state.setdefault(stats.state, []).append(rank)
            ranks.append(
                {
                    "rank": rank,
                    "state": stats.state,
                    "num_blocks": stats.num_blocks,
                    "num_free_blocks": stats.num_free_blocks,
                    "num_running": stats.num_running,
                    "num_waiting": stats.num_waiting,
                    "num_routed": stats.num_routed,
                    "num_in_flight": len(stats.in_flight),
                }
            )
        admission = self.ctx.admission
        load = {"admitted": admission.in_use, "capacity": admission.capacity()}
        if getattr(client, "is_paused", False):
            reason = "Generation is paused (POST /resume continues it); new requests wait."
            body = {"status": "paused", "reason": reason, **by_state, **load, "ranks": ranks}
            return JSONResponse(body, status_code=503)
        if client.ready and not admission.draining:
            return JSONResponse({"status": "ok", **by_state, **load, "ranks": ranks})
        status = (
            "draining"
            if admission.draining
            else "degraded"
            if by_state["ready"] and len(by_state["ready"]) < len(ranks)
            else "unavailable"
        )
        return JSONResponse({"status": status, **by_state, **load, "ranks": ranks}, status_code=503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": _version()})

    async def tokenize(self, request: Request) -> Response:
        body = await _read(request, TokenizeRequest)
        self.ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Send exactly one of `prompt` or `messages`.", "prompt")
        if body.messages is not None:
            check_messages_size(self.ctx, body.messages)
            tokens = await render_prompt_ids(
                self.ctx, body.messages, body.add_generation_prompt, **self.chat.template_args(body)
            )
        else:
            prompt = body.prompt
            assert prompt is not None  # exactly one of the two, checked above
            self.ctx.limits.check_text_size([prompt], "prompt")
            tokens = await run_blocking(self.ctx.tokenizer.encode, prompt, body.add_special_tokens)
        # msgspec, not json.dumps: a million token ids encode in milliseconds, on the loop.
        return Response(
            msgspec.json.encode(
                {"count": len(tokens), "max_model_len": self.ctx.max_model_len, "tokens": tokens}
            ),
            media_type="application/json",
        )

    async def detokenize(self, request: Request) -> Response:
        body = await _read(request, DetokenizeRequest)
        self.ctx.check_model(body.model)
        if body.tokens and max(body.tokens) >= self.ctx.vocab_size:
            raise bad_request(
                f"Token id {max(body.tokens)} is out of the vocabulary (size {self.ctx.vocab_size}).",
                "tokens",
            )
        return JSONResponse({"prompt": await run_blocking(self.ctx.tokenizer.decode, body.tokens)})

    async def metrics(self, request: Request) -> Response:
        return Response(self.ctx.metrics.exposition(), media_type=CONTENT_TYPE)

    def table(self) -> list[Route]:
        return [
            Route("/v1/completions", _client_may_leave(self.create_completion), methods=["POST"]),
            Route("/v1/chat/completions", _client_may_leave(self.create_chat_completion), methods=["POST"]),
            Route("/v1/responses", _client_may_leave(self.create_response), methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            Route("/v1/embeddings", _client_may_leave(self.create_embedding), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenize", _client_may_leave(self.tokenize), methods=["POST"]),
            Route("/detokenize", _client_may_leave(self.detokenize), methods=["POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]


def build_app(
    engine_client: EngineClient,
    tokenizer: Tokenizer,
    config: EngineConfig,
    api_key: str | Sequence[str] | None = None,
    served_model_name: str | Sequence[str] | None = None,
    limits: ServingLimits | None = None,
    chat: ChatSettings | None = None,
    protect_tokenize: bool = True,
    options: APIOptions | None = None,
    kv_transfer_secret: str | None = None,
    responses_store: ResponsesStore | None = None,
    operator: OperatorOptions | None = None,
    admin_api_key: str | Sequence[str] | None = None,
) -> Starlette:
    """The app; its lifespan starts and shuts down ``engine_client``.
    ``api_key``: one key or several (any of them is accepted); with
    ``protect_tokenize`` it guards /tokenize and /detokenize too. ``chat``:
    the chat template and tool-calling options. ``kv_transfer_secret``: the
    P/D proxy's, without which clients may not set kv_transfer_params.
    ``served_model_name``: one name or several; the first is the one responses
    report, any is accepted. ``operator``: CORS, the root path, traces (``--allowed-origins``, ...)."""
    operator = operator or OperatorOptions()
    if chat is not None and chat.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(chat.chat_template)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or ())
    name, aliases = (names or [config.model.served_model_name])[0], tuple(dict.fromkeys(names[1:]))
    limits = limits or ServingLimits()
    engine_client = PausableEngineClient(engine_client, limits.pause_hold_timeout_s)
    metrics = APIMetrics(engine_client.rank_stats, name, config)
    admission = Admission(engine_client, config.scheduler.max_num_seqs, limits)
    metrics.registry.register(ReliabilityCollector(engine_client, admission, name))
    routes = _Routes(
        ServingContext(
            engine_client,
            tokenizer,
            config,
            name,
            metrics,
            admission,
            limits,
            options or APIOptions(),
            kv_transfer_secret,
            tuple(a for a in aliases if a != name),
        ),
        chat,
        responses_store,
    )
    admin_keys = [admin_api_key] if isinstance(admin_api_key, str) else list(admin_api_key or ())
    management = ManagementRoutes(engine_client, admission, routes.model_card, admin_keys)
    table = [*routes.table(), *management.table(), Route("/ping", ping, methods=["GET"])]
    table += OpenAPIRoutes(table, _version(), operator.root_path).table()  # it lists the whole table
    metrics.tracer = start_tracer(operator.otlp_traces_endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine_client.start()
        try:
            yield
        finally:
            await engine_client.shutdown()
            if metrics.tracer is not None:
                await asyncio.to_thread(metrics.tracer.shutdown)  # the last spans go out

    # Outermost first: every exchange returns its tickets; bodies are capped
    # in time and size before anything reads them; keys are checked before any work.
    middleware = [
        *operator_middleware(operator, tracing=metrics.tracer is not None),
        Middleware(TicketReleaseMiddleware),
        Middleware(BodyDeadlineMiddleware, timeout_s=limits.body_timeout_s),
        Middleware(BodySizeLimitMiddleware, max_bytes=limits.max_body_bytes),
        Middleware(JSONContentTypeMiddleware),
    ]
    if api_key:
        middleware.append(
            Middleware(
                APIKeyMiddleware,
                api_keys=api_key,
                protect_tokenize=protect_tokenize,
            )
        )
    app = Starlette(
        routes=table,
        middleware=middleware,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.admission = admission
    app.state.engine_client = engine_client  # the pausable wrapper the routes use
    app.state.limits = limits
    return app
