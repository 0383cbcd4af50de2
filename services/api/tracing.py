"""OpenTelemetry traces (``--otlp-traces-endpoint``, vLLM's flag): one span per engine request.

The span (``llm_request``, kind SERVER) starts when the API received the request and ends
when its last output came back; it carries vLLM's attribute names: the request id, the
model, the sampling parameters, the token counts, and the latencies (time in queue, to the
first token, end to end, and the engine's prefill, decode and inference times, read off
the engine's own clock). A ``traceparent`` header from the client makes the span its child.
Spans leave in batches, on the SDK's thread, over OTLP/HTTP (protobuf).

The SDK is an optional extra (``pip install 'weft[otel]'``), imported only when the flag
is given. Torch-free.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
# The export batch's delay: spans reach the collector within about this long of their end.
EXPORT_DELAY_MS = 1000
# How long one export may take (a collector that is gone holds up the last flush at shutdown this long).
EXPORT_TIMEOUT_S = 5.0
# The client's ``traceparent`` header of the HTTP request whose code is running.
incoming_traceparent: contextvars.ContextVar[str | None] = contextvars.ContextVar("traceparent", default=None)
INSTALL_HINT = "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'weft[otel]'."


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``endpoint`` as given, with ``/v1/traces`` added to a bare host."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL, got {endpoint!r}.")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def check_available() -> None:
    """ValueError with the install line when the SDK is missing (checked before engines start)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL_HINT) from None


@dataclass
class RequestTimes:
    """One engine request's times: ``arrival`` and ``finished`` on the API's monotonic clock, the
    others on the engine's (compared only with each other); None where it never got there."""

    arrival: float
    finished: float
    first_token_api: float | None
    queued: float | None
    scheduled: float | None
    first_token: float | None
    last_token: float | None


class Tracer:
    """Turns finished requests into spans and exports them; ``shutdown`` flushes the last ones."""

    def __init__(self, endpoint: str, service_name: str = "weft") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=EXPORT_TIMEOUT_S),
                schedule_delay_millis=EXPORT_DELAY_MS,
            )
        )
        self._tracer = self._provider.get_tracer("weft")
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()

    def current_parent(self) -> Any:
        """The trace context the running HTTP request's client sent (``traceparent``), or None."""
        traceparent = incoming_traceparent.get()
        return None if traceparent is None else self._propagator.extract({"traceparent": traceparent})

    def record(self, attributes: dict[str, Any], times: RequestTimes, parent: Any = None) -> None:
        now_ns, now = time.time_ns(), time.monotonic()

        def wall_ns(monotonic: float) -> int:
            return now_ns - int((now - monotonic) * 1e9)

        attributes = {k: v for k, v in attributes.items() if v is not None} | _latencies(times)
        span = self._tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=self._kind,
            attributes=attributes,
            start_time=wall_ns(times.arrival),
        )
        span.end(end_time=wall_ns(times.finished))

    def shutdown(self) -> None:
        self._provider.shutdown()


def _latencies(t: RequestTimes) -> dict[str, float]:
    """vLLM's gen_ai.latency.* attributes, in seconds."""
    found = {"gen_ai.latency.e2e": t.finished - t.arrival}
    if t.first_token_api is not None:
        found["gen_ai.latency.time_to_first_token"] = t.first_token_api - t.arrival
    if t.queued is not None and t.scheduled is not None:
        found["gen_ai.latency.time_in_queue"] = max(0.0, t.scheduled - t.queued)
    if t.scheduled is not None and t.first_token is not None and t.last_token is not None:
        found["gen_ai.latency.time_in_model_prefill"] = max(0.0, t.first_token - t.scheduled)
        found["gen_ai.latency.time_in_model_decode"] = max(0.0, t.last_token - t.first_token)
        found["gen_ai.latency.time_in_model_inference"] = max(0.0, t.last_token - t.scheduled)
    return found


class TraceParentMiddleware:
    """Keeps the request's ``traceparent`` header where ``Tracer.current_parent`` reads it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = dict(scope["headers"]).get(b"traceparent")
        token = incoming_traceparent.set(None if value is None else value.decode("latin-1"))
        try:
            await self.app(scope, receive, send)
        finally:
            incoming_traceparent.reset(token)


def start_tracer(endpoint: str | None) -> Tracer | None:
    if endpoint is None:
        return None
    check_available()
    tracer = Tracer(endpoint)
    logger.info("Exporting a trace span per request to %s (OTLP/HTTP).", traces_url(endpoint))
    return tracer
