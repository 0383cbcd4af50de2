"""The P/D proxy against stand-in servers (in-process ASGI, no engines):
what each leg is sent, what the client gets back, and the fallbacks."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.kv_transfer.proxy import BackendPool, PDProxy, build_app, build_parser, prefill_body

PARAMS = {"do_remote_prefill": True, "remote_num_tokens": 32}
SSE = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'


class Servers:
    """Stand-ins for prefill and decode servers, told apart by host name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict, dict]] = []
        self.prefill_status = 200
        self.dead = set()  # hosts that refuse connections
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
                Route("/health", lambda r: JSONResponse({}, 200 if r.url.hostname != "decode-1" else 503)),
                Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "m"}]})),
            ]
        )

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        host = request.url.hostname
        self.calls.append((host, request.url.path, body, dict(request.headers)))
        if host.startswith("prefill"):
            if self.prefill_status != 200:
                return JSONResponse({"error": {"message": "no"}}, self.prefill_status)
            return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if body.get("stream"):
            return Response(SSE, media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "decoded"}], "got": body.get("kv_transfer_params")})

    def transport(self) -> httpx.AsyncBaseTransport:
        asgi = httpx.ASGITransport(app=self.app)
        servers = self

        class Transport(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request):
                if request.url.host in servers.dead:
                    raise httpx.ConnectError("connection refused", request=request)
                return await asgi.handle_async_request(request)

        return Transport()


@pytest.fixture
def servers():
    return Servers()


@pytest.fixture
async def client(servers):
    upstream = httpx.AsyncClient(transport=servers.transport())
    proxy = PDProxy(
        BackendPool(["http://prefill-0", "http://prefill-1"], "round_robin"),
        BackendPool(["http://decode-0"], "round_robin"),
        upstream,
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(proxy)), base_url="http://proxy"
    ) as front:
        front.proxy = proxy
        yield front
    await upstream.aclose()


async def test_prefill_gets_one_token_and_decode_gets_its_params(client, servers):
    body = {
        "prompt": "hello",
        "max_tokens": 20,
        "n": 2,
        "min_tokens": 3,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"do_remote_prefill": True, "remote_num_tokens": 999},
    }
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["got"] == PARAMS
    (p_host, _, p_body, p_headers), (d_host, _, d_body, d_headers) = servers.calls
    assert p_host == "prefill-0" and d_host == "decode-0"
    assert p_body["max_tokens"] == 1 and p_body["n"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "min_tokens" not in p_body and "stream_options" not in p_body
    # The decode leg is the client's own request, with the producer's params only.
    assert d_body == {**body, "kv_transfer_params": PARAMS}
    assert p_headers["x-request-id"] == d_headers["x-request-id"]


async def test_a_stream_is_relayed_as_the_decode_server_sent_it(client, servers):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_completion_tokens": 9}
    response = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
    assert response.status_code == 200 and response.content == SSE
    assert response.headers["content-type"].startswith("text/event-stream")
    (_, path, p_body, p_headers), (_, _, d_body, d_headers) = servers.calls
    assert path == "/v1/chat/completions" and p_body["max_completion_tokens"] == 1
    assert d_body["stream"] is True and d_body["max_completion_tokens"] == 9
    assert (
        "authorization" not in p_headers and "authorization" not in d_headers
    )  # the client's: never passed on
    assert client.proxy.decode.in_flight == {"http://decode-0": 0}


async def test_a_client_error_at_prefill_goes_back_without_a_decode(client, servers):
    servers.prefill_status = 400
    response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 400 and len(servers.calls) == 1


@pytest.mark.parametrize("failure", ["http 500", "http 403", "refused"])
async def test_a_failed_prefill_leaves_the_decode_server_to_compute(client, servers, failure):
    """A 403 is the prefill server not trusting the proxy's kv_transfer_params: not the client's fault."""
    if failure == "refused":
        servers.dead = {"prefill-0", "prefill-1"}
    else:
        servers.prefill_status = int(failure.split()[1])
    response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 200 and response.json()["got"] is None
    assert servers.calls[-1][0] == "decode-0" and client.proxy.num_prefill_failures == 1


async def test_a_dead_decode_server_is_a_502(client, servers):
    servers.dead = {"decode-0"}
    response = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    message = response.json()["error"]["message"]
    assert response.status_code == 502 and "decode server failed" in message and "decode-0" not in message
    assert client.proxy.decode.in_flight == {"http://decode-0": 0}


async def test_bad_bodies_are_refused_before_any_leg(client, servers):
    assert (await client.post("/v1/completions", content=b"{nope")).status_code == 400
    assert (await client.post("/v1/completions", json=[1])).status_code == 400
    assert not servers.calls


async def test_prefill_servers_take_turns(client, servers):
    for _ in range(3):
        await client.post("/v1/completions", json={"prompt": "x"})
    assert [c[0] for c in servers.calls if c[0].startswith("prefill")] == [
        "prefill-0",
        "prefill-1",
        "prefill-0",
    ]


async def test_health_and_models(client, servers):
    health = await client.get("/health")
    assert health.status_code == 200
    assert set(health.json()["servers"]) == {"prefill-0", "prefill-1", "decode-0"}
    assert "http://" not in health.text  # the servers' addresses stay private
    servers.dead = {"prefill-1"}
    assert (await client.get("/health")).status_code == 503
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == "m"


def test_least_loaded_picks_the_idlest_server():
    pool = BackendPool(["http://a", "http://b/"], "least_loaded")
    assert pool.urls == ["http://a", "http://b"]
    first, second = pool.acquire(), pool.acquire()
    assert {first, second} == {"http://a", "http://b"}
    pool.release("http://b")
    assert pool.acquire() == "http://b"
    with pytest.raises(ValueError):
        BackendPool([], "round_robin")
    with pytest.raises(ValueError, match="policy"):
        BackendPool(["http://a"], "random")


def test_prefill_body_and_cli():
    assert prefill_body({"messages": [], "max_tokens": 5})["max_tokens"] == 1
    assert "best_of" not in prefill_body({"prompt": "x", "n": 2, "best_of": 2})  # it must equal n, now 1
    args = build_parser().parse_args(
        [
            "--prefill",
            "http://p:1",
            "--decode",
            "http://d:1",
            "http://d:2",
            "--port",
            "9000",
            "--policy",
            "least_loaded",
        ]
    )
    assert args.decode == ["http://d:1", "http://d:2"] and args.port == 9000
    assert json.loads(json.dumps(prefill_body({"n": 3})))["n"] == 1
