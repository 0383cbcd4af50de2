"""Issue 44 #12: ``weft pd-proxy`` as a real process in front of stand-in
servers (real uvicorn, real sockets, no model). Before: plain
``uvicorn.run`` with no header or body deadline and no connection cap, the
client's ``Authorization`` forwarded to both servers, and no drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.ports import free_port
from tests.polling import wait_until
from tests.utils import REPO_ROOT

pytestmark = pytest.mark.slow

DEADLINE_S = 0.5
MAX_CONNECTIONS = 3
START_S = 60.0
CLIENT_KEY, BACKEND_KEY = "client-key", "backend-key"


class Backend:
    """A stand-in prefill and decode server (one app, both roles); ``held`` requests wait for ``release``."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []
        self.hold = False
        self.release = asyncio.Event()
        self.waiting = 0
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/health", lambda _: JSONResponse({}), methods=["GET"]),
            ]
        )

    async def generate(self, request: Request):
        self.authorizations.append(request.headers.get("authorization"))
        body = await request.json()
        if body.get("max_tokens") != 1 and self.hold:  # the decode leg
            self.waiting += 1
            await self.release.wait()
        return JSONResponse({"choices": [{"text": "ok"}], "kv_transfer_params": None})


@contextlib.asynccontextmanager
async def backend():
    stand_in = Backend()
    server = uvicorn.Server(uvicorn.Config(stand_in.app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started or task.done(), 30, "the stand-in server to start")
        stand_in.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        yield stand_in
    finally:
        stand_in.release.set()
        server.should_exit = True
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def proxy(tmp_path, upstream: str):
    keys = {}
    for name, key in (("client", CLIENT_KEY), ("backend", BACKEND_KEY)):
        keys[name] = tmp_path / f"{name}-key"
        keys[name].write_text(key + "\n")
        os.chmod(keys[name], 0o600)
    port = free_port()
    command = [
        sys.executable, "-m", "services.cli", "pd-proxy",
        "--prefill", upstream, "--decode", upstream, "--host", "127.0.0.1", "--port", str(port),
        "--body-timeout", str(DEADLINE_S), "--max-connections", str(MAX_CONNECTIONS),
        "--shutdown-timeout", "30", "--api-key-file", str(keys["client"]),
        "--backend-api-key-file", str(keys["backend"]),
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        assert process.poll() is None, "the proxy exited"
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(url + "/health", timeout=5)).status_code == 200
        except httpx.TransportError:
            return False

    try:
        await wait_until(healthy, START_S, "the proxy to answer /health")
        yield process, port, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def completion(url: str, key: str | None = CLIENT_KEY, **kwargs):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    client = httpx.AsyncClient(timeout=60)
    return client, client.post(
        url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, headers=headers
    )


async def post(url: str, key: str | None = CLIENT_KEY) -> httpx.Response:
    client, request = completion(url, key)
    async with client:
        return await request


async def test_slow_clients_the_connection_cap_and_keys(tmp_path):
    async with backend() as stand_in, proxy(tmp_path, stand_in.url) as (_, port, url):
        # Keys: the proxy checks the client's, and the servers see only the proxy's own.
        assert (await post(url, key=None)).status_code == 401
        assert (await post(url, key="guess")).status_code == 401
        assert stand_in.authorizations == []
        assert (await post(url)).status_code == 200
        assert stand_in.authorizations == [f"Bearer {BACKEND_KEY}"] * 2  # prefill and decode legs
        # Headers that never finish: the connection is closed after the deadline.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert await asyncio.wait_for(reader.read(), 30) == b""
        writer.close()
        # A body that never finishes: 408, and the connection closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Length: 100\r\n\r\n{" % CLIENT_KEY.encode()
        )
        answer = await asyncio.wait_for(reader.read(), 30)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        writer.close()
        # The connection cap: requests held at the server fill it (uvicorn counts the new
        # connection too), the next gets 503 at once.
        stand_in.hold = True
        held = [completion(url) for _ in range(MAX_CONNECTIONS - 1)]
        tasks = [asyncio.create_task(request) for _, request in held]
        await wait_until(lambda: stand_in.waiting == len(held), 30, "the held requests")
        assert (await post(url)).status_code == 503
        stand_in.release.set()
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * len(held)
        for client, _ in held:
            await client.aclose()


async def test_sigterm_drains(tmp_path):
    async with backend() as stand_in, proxy(tmp_path, stand_in.url) as (process, port, url):
        stand_in.hold = True
        client, request = completion(url)
        in_flight = asyncio.create_task(request)
        await wait_until(lambda: stand_in.waiting == 1, 30, "the request to reach the decode leg")
        process.send_signal(signal.SIGTERM)

        # New requests are refused (the listener is closed) while the one in flight goes on.
        async def refused() -> bool:
            try:  # a connection that raced the listener's close can hang: then try a new one
                return (await asyncio.wait_for(post(url), 2)).status_code == 503
            except httpx.ConnectError:
                return True
            except TimeoutError:
                return False

        await wait_until(refused, 30, "new requests to be refused")
        assert not in_flight.done() and process.poll() is None
        stand_in.release.set()
        assert (await in_flight).status_code == 200
        await client.aclose()
        await wait_until(lambda: process.poll() is not None, 30, "the proxy to exit")
        assert process.returncode == 0
