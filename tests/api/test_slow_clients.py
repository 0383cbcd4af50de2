"""Slow clients against a real uvicorn (in this process, on this loop).

A client that trickles its body, or never finishes its headers, must lose
its connection after the deadline rather than hold it forever, and the
connection limit must turn the excess away at once, while other clients are
served all along. The attackers are raw sockets: an HTTP client would not
misbehave this way.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import uvicorn

from services.api.limits import ServingLimits
from services.api.slow_clients import header_deadline_protocol
from tests.api.fake_engine_client import make_app
from tests.polling import wait_until

DEADLINE_S = 0.5
TRICKLE_INTERVAL_S = DEADLINE_S / 20  # the attacker's pace: a byte every this many seconds


@contextlib.asynccontextmanager
async def running_server(max_connections: int = 100):
    app, _ = make_app(limits=ServingLimits(body_timeout_s=DEADLINE_S))
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="on",
        limit_concurrency=max_connections,
        timeout_keep_alive=5,
        http=header_deadline_protocol(DEADLINE_S),
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started or task.done(), 30, "uvicorn to start")
        assert not task.done(), task
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> int:
    """Send ``data`` a byte at a time until the server hangs up; how many bytes went."""
    sent = 0
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            sent += 1
            await asyncio.sleep(TRICKLE_INTERVAL_S)  # the attack's pace, not a wait for anything
    return sent


async def read_to_close(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection, read to EOF or to a reset: a server
    that closes with the attacker's latest bytes still unread in its socket makes TCP send RST,
    not FIN, and which of the two arrives depends on how soon the server read them."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await reader.read(65536):
            received += chunk
    return received


async def still_served(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        response = await client.post("/tokenize", json={"prompt": "Hi"})
        assert response.status_code == 200, response.text


async def test_a_trickled_body_gets_408_and_loses_its_connection():
    body = b'{"prompt": "' + b"x" * 10_000 + b'"}'
    async with running_server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /tokenize HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        trickler = asyncio.create_task(trickle(writer, body))
        await still_served(port)  # others are served while the attacker trickles
        response = await asyncio.wait_for(reader.read(), 60)  # to EOF: the server closes
        sent = await asyncio.wait_for(trickler, 60)
        writer.close()
        assert response.startswith(b"HTTP/1.1 408"), response
        assert b"did not arrive within" in response
        assert sent < len(body) / 2  # it was cut off, not waited for
        await still_served(port)


@pytest.mark.parametrize("head", [b"", b"POST /tokenize HTTP/1.1\r\nHost: test\r\nContent-Le"])
async def test_headers_that_never_complete_lose_their_connection(head):
    async with running_server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)
        trickler = asyncio.create_task(trickle(writer, b"ngth: 5" + b"x" * 10_000))
        response = await asyncio.wait_for(read_to_close(reader), 60)  # closed without an answer
        sent = await asyncio.wait_for(trickler, 60)
        writer.close()
        assert response == b""
        assert sent < 5_000
        await still_served(port)


async def test_a_kept_alive_connection_gets_the_deadline_for_its_next_request():
    async with running_server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /version HTTP/1.1\r\nHost: test\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).startswith(b"HTTP/1.1 200")
        next_head = b"GET /version HTTP/1.1\r\nHost: t" + b"x" * 10_000
        sent = await asyncio.wait_for(trickle(writer, next_head), 60)
        writer.close()
        assert sent < 5_000


async def test_connections_past_the_limit_get_503_at_once():
    async with running_server(max_connections=2) as port:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert (await client.get("/version")).status_code == 503
        for reader, writer in idle:  # the deadline frees their places
            assert await asyncio.wait_for(reader.read(), 60) == b""
            writer.close()
        await still_served(port)
