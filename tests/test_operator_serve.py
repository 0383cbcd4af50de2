"""The operator plumbing through one real `weft serve` (the default model, one engine core):
CORS, a root path, X-Request-Id, JSON logs, /ping, /openapi.json and /docs, OTLP traces to an
in-process collector, and the load progress in the log. TLS has its own server:
tests/test_tls_serve.py."""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from openapi_spec_validator import validate
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from benchmarks.stack import Stack
from tests.api.fake_engine_client import make_app
from tests.polling import wait_for

pytestmark = pytest.mark.slow

KEY = "operator-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"
ROOT = "/weft"
WAIT_S = 30
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Collector:
    """An OTLP/HTTP traces receiver on loopback: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            spans.extend(scope.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans_of(self, request_id: str) -> list:
        return [s for s in list(self.spans) if _attributes(s).get("gen_ai.request.id") == request_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _attributes(span) -> dict:
    found = {}
    for kv in span.attributes:
        value = kv.value
        found[kv.key] = getattr(value, value.WhichOneof("value"))
    return found


@pytest.fixture(scope="module")
def collector():
    collector = Collector()
    yield collector
    collector.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, collector):
    stack = Stack(
        [
            "--api-key",
            KEY,
            "--allowed-origins",
            json.dumps([ORIGIN]),
            "--root-path",
            ROOT,
            "--log-format",
            "json",
            "--otlp-traces-endpoint",
            collector.url,
            "--max-model-len",
            "512",
            "--num-threads",
            "1",
            "--num-gpu-blocks-override",
            "64",
        ],
        tmp_path_factory.mktemp("logs"),
    )
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.kill()


@pytest.fixture
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


def _complete(base_url: str, request_id: str | None = None, **headers):
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    with client:
        return client.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct",
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0.0,
            extra_headers=headers,
        )


def test_cors_preflight_and_response_headers(http):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-request-id",
    }
    allowed = http.options("/v1/chat/completions", headers=preflight)  # no key: the browser sends none
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    refused = http.options("/v1/chat/completions", headers=preflight | {"Origin": "http://evil.example"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    response = http.get("/v1/models", headers=AUTH | {"Origin": ORIGIN})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in response.headers["access-control-expose-headers"].lower()


def test_root_path_serves_under_the_prefix_and_without_it(stack, http):
    prefixed = _complete(f"{stack.url}{ROOT}/v1")
    plain = _complete(f"{stack.url}/v1")  # what a proxy that strips the prefix sends on
    assert prefixed.parse().choices[0].text == plain.parse().choices[0].text
    docs = http.get(f"{ROOT}/docs")
    assert docs.status_code == 200 and f'"{ROOT}/openapi.json"' in docs.text
    assert http.get(f"{ROOT}/openapi.json").json()["servers"] == [{"url": ROOT}]
    assert http.get("/weftish/v1/models", headers=AUTH).status_code == 404  # only the whole segment
    assert http.get(f"{ROOT}/v1/models").status_code == 401  # the key is checked under the prefix too


def test_request_id_round_trip_and_refusal(stack):
    raw = _complete(f"{stack.url}/v1", "client-id-1")
    assert raw.headers["x-request-id"] == "client-id-1" and raw.parse().id == "cmpl-client-id-1"
    with pytest.raises(openai.BadRequestError, match="X-Request-Id"):
        _complete(f"{stack.url}/v1", "not ok!")


def test_json_log_lines_carry_the_request_id_and_rank(stack):
    _complete(f"{stack.url}/v1", "logged-id-2")

    def lines():
        return [line for line in stack.log_path.read_text().splitlines() if line.strip()]

    wait_for(lambda: "logged-id-2" in stack.log_path.read_text(), WAIT_S, "the request's log line")
    records = [json.loads(line) for line in lines()]  # every line is one JSON object
    assert any(r.get("request_id") == "logged-id-2" and r["logger"] == "uvicorn.access" for r in records)
    engine = [r for r in records if r.get("process") == "engine-core"]
    assert engine and all(r["rank"] == 0 for r in engine)
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)


def test_load_progress_is_logged(stack):
    messages = [json.loads(line)["message"] for line in stack.log_path.read_text().splitlines() if line]
    assert any(m.startswith("Loading the weights of") for m in messages)
    assert any(m.startswith("Loaded the weights in") for m in messages)
    # Each CPU kernel either built now or was found built, and says which.
    assert any(("built before" in m or m.startswith("Built ")) for m in messages)
    assert any(m.startswith("Engine core rank 0 ready") and m.endswith(" s.") for m in messages)


def test_ping_is_open_and_health_is_readiness(http):
    for path in ("/ping", f"{ROOT}/ping"):
        ping = http.get(path)  # no key needed
        assert ping.status_code == 200 and ping.json() == {"status": "alive"}
    assert http.get("/health").json()["status"] == "ok"


def test_openapi_json_validates_and_lists_every_route(http):
    document = http.get("/openapi.json").json()
    validate(document)
    app, _ = make_app()  # the same route table, built in process
    expected = {route.path.replace("{model:path}", "{model}") for route in app.routes}
    assert set(document["paths"]) == expected


def test_one_span_per_request_with_its_phase_times(stack, collector):
    for request_id in ("traced-1", "traced-2"):
        _complete(f"{stack.url}/v1", request_id, traceparent=TRACEPARENT)
    for request_id in ("traced-1", "traced-2"):
        wait_for(
            lambda rid=request_id: collector.spans_of(f"cmpl-{rid}"), WAIT_S, f"the span of {request_id}"
        )
    (span,) = collector.spans_of("cmpl-traced-1")
    assert len(collector.spans_of("cmpl-traced-2")) == 1
    attributes = _attributes(span)
    assert span.name == "llm_request" and span.trace_id.hex() == TRACEPARENT.split("-")[1]
    assert span.parent_span_id.hex() == TRACEPARENT.split("-")[2]
    assert attributes["gen_ai.usage.completion_tokens"] == 4
    assert attributes["gen_ai.request.max_tokens"] == 4
    for name in (
        "time_in_queue",
        "time_to_first_token",
        "e2e",
        "time_in_model_prefill",
        "time_in_model_decode",
        "time_in_model_inference",
    ):
        assert attributes[f"gen_ai.latency.{name}"] >= 0.0, name
    assert span.end_time_unix_nano > span.start_time_unix_nano
