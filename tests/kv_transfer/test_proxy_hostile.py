"""The P/D proxy as the public front, under hostile or careless clients and
stuck servers: oversize bodies, smuggled trust headers, clients that leave
mid-request, servers that accept a connection and never answer."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.kv_transfer import trust
from services.kv_transfer.proxy import BackendPool, PDProxy, build_app
from tests.polling import wait_until

PARAMS = {"do_remote_prefill": True, "remote_num_tokens": 32}


class Servers:
    """Stand-in prefill and decode servers; ``hold`` makes a role's handler
    wait until cancelled (the proxy closed its connection)."""

    def __init__(self) -> None:
        self.headers: list[dict] = []
        self.hold: set[str] = set()
        self.started: set[str] = set()
        self.cancelled: set[str] = set()
        self.app = Starlette(routes=[Route("/v1/completions", self.generate, methods=["POST"])])

    async def generate(self, request: Request):
        role = request.url.hostname.split("-")[0]
        self.headers.append(dict(request.headers))
        await request.body()
        if role in self.hold:
            self.started.add(role)
            try:
                await asyncio.Event().wait()
            finally:
                self.cancelled.add(role)
        if role == "prefill":
            return JSONResponse({"kv_transfer_params": PARAMS})
        return JSONResponse({"choices": [{"text": "ok"}]})


def make_proxy(servers: Servers, **kwargs) -> PDProxy:
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=servers.app))
    return PDProxy(
        BackendPool(["http://prefill-0"], "round_robin"),
        BackendPool(["http://decode-0"], "round_robin"),
        upstream,
        **kwargs,
    )


async def post(proxy: PDProxy, body: bytes, headers: dict | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(proxy))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        return await c.post("/v1/completions", content=body, headers=headers or {})


async def test_an_oversize_body_is_refused_before_any_leg():
    servers = Servers()
    proxy = make_proxy(servers, max_body_bytes=1024)
    response = await post(proxy, json.dumps({"prompt": "x" * 2000}).encode())
    assert response.status_code == 413 and "1024" in response.json()["error"]["message"]
    assert servers.headers == []
    assert (await post(proxy, json.dumps({"prompt": "x"}).encode())).status_code == 200


async def test_the_proxy_alone_vouches_for_kv_transfer_params():
    servers = Servers()
    smuggled = {trust.HEADER: "guessed", "content-type": "application/json"}
    # No secret: the client's own header is not passed on.
    await post(make_proxy(servers), b'{"prompt": "x"}', smuggled)
    assert all(trust.HEADER not in h for h in servers.headers)
    servers.headers.clear()
    await post(make_proxy(servers, secret="s3cret"), b'{"prompt": "x"}', smuggled)
    assert [h[trust.HEADER] for h in servers.headers] == ["s3cret", "s3cret"]  # both legs, its own value


async def _call_and_leave(proxy: PDProxy, servers: Servers, role: str) -> list[dict]:
    """Drive the proxy's ASGI app as a server would, with a client that
    disconnects once ``role``'s server is working on the request."""
    body = json.dumps({"prompt": "x", "max_tokens": 50}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    left = asyncio.Event()

    async def receive():
        if messages:
            return messages.pop(0)
        await left.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("proxy", 80),
    }
    call = asyncio.ensure_future(build_app(proxy)(scope, receive, send))
    await wait_until(lambda: role in servers.started, 10, f"the {role} server to start")
    left.set()
    await asyncio.wait_for(call, 10)
    return sent


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_client_that_leaves_closes_the_legs(role):
    servers = Servers()
    servers.hold = {role}
    proxy = make_proxy(servers)
    await _call_and_leave(proxy, servers, role)
    await wait_until(lambda: role in servers.cancelled, 10, f"the {role} leg to be closed")
    assert proxy.num_client_disconnects == 1
    if role == "prefill":
        assert len(servers.headers) == 1  # no decode was started for a client that is gone
    assert proxy.decode.in_flight == {"http://decode-0": 0}
    assert proxy.prefill.in_flight == {"http://prefill-0": 0}


async def test_a_server_that_never_answers_times_out_and_its_url_stays_private():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the backlog; nothing is ever read or written
    port = silent.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proxy = PDProxy(BackendPool([url], "round_robin"), BackendPool([url], "round_robin"), read_timeout_s=0.3)
    proxy.client = httpx.AsyncClient(timeout=proxy.timeout)  # real sockets: timeouts apply
    try:
        response = await post(proxy, b'{"prompt": "x"}')
    finally:
        await proxy.client.aclose()
        silent.close()
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "ReadTimeout" in message and "127.0.0.1" not in message and str(port) not in message
    assert proxy.num_prefill_failures == 1  # the prefill timed out too, and cost only speed
