"""``weft pd-proxy``: one OpenAI-compatible front for disaggregated prefill/decode.

Each completion or chat request runs in two legs (vLLM's proxy pattern):

1. prefill: a copy of the request goes to a prefill server with
   ``max_tokens=1``, no streaming, ``n=1`` and ``kv_transfer_params =
   {"do_remote_decode": true}``; that engine computes the prompt's KV, hands
   it to the connector, and answers with the ``kv_transfer_params`` a
   decode engine needs;
2. decode: the original request plus those parameters goes to a decode
   server, whose answer (streamed or whole) is passed to the client as is.

Both legs carry the same ``X-Request-Id``, and the deployment's secret in
``X-Weft-KV-Transfer-Key`` (``--kv-transfer-secret-file``): the servers
accept ``kv_transfer_params`` from the proxy only (``trust``). A prefill
server that fails (unreachable, 5xx) costs only speed: the decode server
then gets the plain request and computes the prompt itself; so does a 403,
the prefill server refusing the proxy's own parameters (a missing or wrong
secret). Any other 4xx from the prefill server is the client's error, and
goes back to the client. Servers
are picked per pool by round robin or by the fewest requests this proxy has
in flight on them.

As the public front of a P/D deployment it bounds what a client can cost: a
body over ``--max-request-body-bytes`` is refused (413) before any leg runs;
connecting to a server, and each wait for its next bytes, are bounded; a
client that leaves mid-request closes both legs, so neither server keeps
generating for no one; and errors name the role of a failed server, never
its URL (which only the logs show). As ``weft serve`` does, it closes a
connection whose headers take over ``--body-timeout`` and answers 408 to a
body that does, serves at most ``--max-connections`` at once (503 beyond),
and on SIGTERM stops accepting, answers 503 to new requests and lets those
in flight finish for ``--shutdown-timeout``. A client's ``Authorization``
is the proxy's to check (``--api-key-file`` or ``$WEFT_API_KEY``), never
passed on: the servers get the proxy's own key (``--backend-api-key-file``).
Torch-free: Starlette, httpx and uvicorn only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import signal
import stat
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services import env
from services.api.errors import APIError
from services.api.limits import DEFAULT_BODY_TIMEOUT_S, BodyDeadlineMiddleware
from services.kv_transfer import trust
from services.processes import DEFAULT_SHUTDOWN_TIMEOUT_S

logger = logging.getLogger("weft.pd_proxy")
T = TypeVar("T")

POLICIES = ("round_robin", "least_loaded")
DEFAULT_MAX_BODY_BYTES = 8 << 20
# The longest wait for a server's next bytes: a whole prefill or a whole
# non-streaming decode (one response, sent when done: long generations on a
# CPU take minutes), or the gap between two chunks of a stream.
DEFAULT_READ_TIMEOUT_S = 600.0
_CONNECT_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_KEEP_ALIVE_S = 5.0
# Request headers worth passing on to the servers (never the client's own
# X-Weft-KV-Transfer-Key, which only the proxy sets, nor its Authorization,
# which is the proxy's to check: the servers get the proxy's own key).
_FORWARDED_HEADERS = ("x-request-id",)


class ClientGone(Exception):
    """The client disconnected while a leg ran."""


class BackendPool:
    """The servers of one role: ``acquire`` picks one and counts it busy until ``release``."""

    def __init__(self, urls: list[str], policy: str) -> None:
        if not urls:
            raise ValueError("a pool needs at least one server URL")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}.")
        self.urls = [url.rstrip("/") for url in urls]
        self.policy = policy
        self.in_flight = {url: 0 for url in self.urls}
        self._next = itertools.cycle(self.urls)

    def acquire(self) -> str:
        if self.policy == "round_robin":
            url = next(self._next)
        else:
            url = min(self.urls, key=lambda u: self.in_flight[u])  # the first of the least busy
        self.in_flight[url] += 1
        return url

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's request: one token, whole, one choice, KV handed on."""
    # best_of must equal n, which becomes 1 here.
    prefill = {
        key: value for key, value in body.items() if key not in ("stream_options", "min_tokens", "best_of")
    }
    prefill.update(
        stream=False,
        max_tokens=1,
        n=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


class PDProxy:
    def __init__(
        self,
        prefill: BackendPool,
        decode: BackendPool,
        client: httpx.AsyncClient | None = None,
        *,
        secret: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        api_keys: list[str] | None = None,
        backend_key: str | None = None,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.client = client  # opened with the app when not given
        self.secret = secret  # sent to the servers with kv_transfer_params (trust.HEADER)
        self.api_keys = [key.encode() for key in api_keys or []]  # what clients must present (none: open)
        self.backend_key = backend_key  # the proxy's own Authorization to the servers
        self.body_timeout_s = body_timeout_s
        self.draining = False  # SIGTERM: new requests get 503, those in flight finish
        self.max_body_bytes = max_body_bytes
        self.timeout = httpx.Timeout(read_timeout_s, connect=_CONNECT_TIMEOUT_S)
        self.num_prefill_failures = 0  # requests decoded without a transfer
        self.num_client_disconnects = 0  # requests whose legs were closed because the client left

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "/v1/chat/completions")

    def _refusal(self, request: Request) -> Response | None:
        """503 while draining; 401 without one of ``api_keys`` (when any is set)."""
        if self.draining:
            return JSONResponse(
                {"error": {"message": "The proxy is shutting down.", "type": "proxy_error", "code": 503}},
                status_code=503,
                headers={"connection": "close", "retry-after": "1"},
            )
        if self.api_keys:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
            if not any(hmac.compare_digest(given, key) for key in self.api_keys):
                return _error("A valid API key is needed (Authorization: Bearer KEY).", 401)
        return None

    async def _handle(self, request: Request, path: str) -> Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        raw = await self._read_body(request)
        if isinstance(raw, Response):
            return raw
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            return _error(f"The body is not valid JSON: {type(e).__name__}", 400)
        if not isinstance(body, dict):
            return _error("The body must be a JSON object.", 400)
        headers = self._headers(request)
        try:
            prefill = self._run_prefill(path, prefill_body(body), headers)
            params = await _unless_client_leaves(request, prefill)
            if isinstance(params, Response):
                return params  # the client's own error
            decode = {key: value for key, value in body.items() if key != "kv_transfer_params"}
            if params is not None:
                decode["kv_transfer_params"] = params
            return await self._run_decode(request, path, decode, headers, stream=bool(body.get("stream")))
        except ClientGone:
            self.num_client_disconnects += 1
            logger.info("The client of request %s left; both legs closed.", headers["x-request-id"])
            return Response(status_code=499)

    async def _read_body(self, request: Request) -> bytes | Response:
        """The body, or a 413 once it passes ``max_body_bytes`` (read no further)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return _error(f"The body is larger than {self.max_body_bytes} bytes.", 413)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    return _error(f"The body is larger than {self.max_body_bytes} bytes.", 413)
                chunks.append(chunk)
        except APIError as e:  # the body took over --body-timeout (BodyDeadlineMiddleware)
            response = _error(e.message, e.status)
            response.headers["connection"] = "close"
            return response
        return b"".join(chunks)

    def _backend_headers(self, request: Request) -> dict[str, str]:
        headers = _forwarded_headers(request)
        if self.backend_key is not None:
            headers["authorization"] = f"Bearer {self.backend_key}"
        return headers

    def _headers(self, request: Request) -> dict[str, str]:
        headers = self._backend_headers(request)
        if self.secret is not None:
            headers[trust.HEADER] = self.secret
        return headers

    async def _run_prefill(self, path: str, body: dict, headers: dict) -> dict | Response | None:
        """The prefill server's ``kv_transfer_params``; its response if the
        request is at fault (4xx); None when the decode must compute the prompt."""
        url = self.prefill.acquire()
        try:
            response = await self.client.post(url + path, json=body, headers=headers, timeout=self.timeout)
        except httpx.HTTPError as e:
            return self._prefill_failed(url, f"{type(e).__name__}: {e}")
        finally:
            self.prefill.release(url)
        if response.status_code == 403:  # it refused the proxy's own kv_transfer_params: a deployment fault
            return self._prefill_failed(
                url, "HTTP 403: it does not trust this proxy (--kv-transfer-secret-file)"
            )
        if 400 <= response.status_code < 500:
            return Response(response.content, response.status_code, media_type="application/json")
        if response.status_code != 200:
            return self._prefill_failed(url, f"HTTP {response.status_code}")
        try:
            params = response.json().get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            return self._prefill_failed(url, "a response that is not a JSON object")
        return params if isinstance(params, dict) else None

    def _prefill_failed(self, url: str, reason: str) -> None:
        self.num_prefill_failures += 1
        logger.warning("Prefill at %s failed (%s); the decode server computes the prompt.", url, reason)
        return None

    async def _run_decode(
        self, client_request: Request, path: str, body: dict, headers: dict, stream: bool
    ) -> Response:
        url = self.decode.acquire()
        request = self.client.build_request(
            "POST", url + path, json=body, headers=headers, timeout=self.timeout
        )
        try:
            # A whole response is read inside send(): a client that leaves meanwhile closes it.
            upstream = await _unless_client_leaves(client_request, self.client.send(request, stream=stream))
        except httpx.HTTPError as e:
            self.decode.release(url)
            logger.warning("The decode server %s failed: %s: %s", url, type(e).__name__, e)
            return _error(f"The decode server failed ({type(e).__name__}).", 502)
        except ClientGone:
            self.decode.release(url)
            raise
        if not stream:
            self.decode.release(url)
            return Response(
                upstream.content,
                upstream.status_code,
                media_type=upstream.headers.get("content-type", "application/json"),
            )
        relay = _Relay(url, upstream, self.decode)
        # The background task also runs when the client left before the first byte.
        return StreamingResponse(
            relay.chunks(),
            status_code=upstream.status_code,
            background=BackgroundTask(relay.close),
            media_type=upstream.headers.get("content-type", "text/event-stream"),
        )

    async def models(self, request: Request) -> Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        url = self.decode.urls[0]
        try:
            response = await self.client.get(
                url + "/v1/models", headers=self._backend_headers(request), timeout=self.timeout
            )
        except httpx.HTTPError as e:
            logger.warning("The decode server %s failed: %s: %s", url, type(e).__name__, e)
            return _error(f"The decode server failed ({type(e).__name__}).", 502)
        return Response(response.content, response.status_code, media_type="application/json")

    async def health(self, request: Request) -> Response:
        """200 when every server answers its /health with 200. Servers are
        named by role and index (``prefill-0``): their URLs stay private."""
        servers = {}
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            for i, url in enumerate(pool.urls):
                try:
                    ok = (await self.client.get(url + "/health", timeout=5.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                servers[f"{role}-{i}"] = {"role": role, "healthy": ok, "in_flight": pool.in_flight[url]}
        healthy = all(s["healthy"] for s in servers.values())
        return JSONResponse(
            {"status": "ok" if healthy else "unavailable", "servers": servers},
            status_code=200 if healthy else 503,
        )


class _Relay:
    """A decode server's stream passed on as it comes; closing it (the client
    left, or the stream ended) closes the upstream one, so that server aborts."""

    def __init__(self, url: str, upstream: httpx.Response, pool: BackendPool) -> None:
        self.url, self.upstream, self.pool = url, upstream, pool
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            logger.warning("The stream from %s broke: %s", self.url, e)
        finally:
            await self.close()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.pool.release(self.url)
            await self.upstream.aclose()


async def _unless_client_leaves(request: Request, leg: Awaitable[T]) -> T:
    """Await ``leg``; if the client disconnects first, cancel it (closing its
    connection, so the server aborts the request) and raise ClientGone."""
    task = asyncio.ensure_future(leg)
    watcher = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone
    return task.result()


async def _client_left(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _forwarded_headers(request: Request) -> dict[str, str]:
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    headers.setdefault("x-request-id", uuid.uuid4().hex)  # the same on both legs
    return headers


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "proxy_error", "code": status}}, status_code=status
    )


def build_app(proxy: PDProxy) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        owned = proxy.client is None
        if owned:
            proxy.client = httpx.AsyncClient(timeout=proxy.timeout, limits=httpx.Limits(max_connections=None))
        try:
            yield
        finally:
            if owned:
                await proxy.client.aclose()
                proxy.client = None

    routes = [
        Route("/v1/completions", proxy.completions, methods=["POST"]),
        Route("/v1/chat/completions", proxy.chat_completions, methods=["POST"]),
        Route("/v1/models", proxy.models, methods=["GET"]),
        Route("/health", proxy.health, methods=["GET"]),
    ]
    middleware = [Middleware(BodyDeadlineMiddleware, timeout_s=proxy.body_timeout_s)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.proxy = proxy
    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weft pd-proxy",
        description=(
            "OpenAI-compatible proxy for disaggregated prefill/decode: each request is prefilled on a "
            "--prefill server (kv_producer) and decoded on a --decode server (kv_consumer)."
        ),
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="Prefill servers, e.g. http://127.0.0.1:8100.",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="Decode servers, e.g. http://127.0.0.1:8200.",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--policy", choices=POLICIES, default="round_robin", help="How a server is picked in each pool."
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="Larger bodies get a 413 before any leg runs (default 8 MiB).",
    )
    parser.add_argument(
        "--backend-read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        help="Longest wait for a server's next bytes: a whole prefill, or between two "
        "chunks of a stream (default 600 s; connecting: 10 s).",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="Seconds a request's headers, then its body, may take to arrive (beyond: the "
        "connection is closed; 408 for a body; default 30).",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="Most connections and tasks served at once; more get 503 at once (default 2048).",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=DEFAULT_KEEP_ALIVE_S,
        help="Seconds an idle keep-alive connection stays open (default 5).",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="On SIGTERM: seconds the requests in flight may take to finish; new ones get 503 (default %(default)g).",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="Keys clients must present (Authorization: Bearer KEY), one per line (default: "
        "$WEFT_API_KEY, comma-separated; neither: open). Never passed on to the servers.",
    )
    parser.add_argument(
        "--backend-api-key-file",
        default=None,
        metavar="FILE",
        help="The API key the proxy presents to the prefill and decode servers (default: none).",
    )
    trust.add_secret_arg(parser)
    return parser


def _private_lines(path: str, flag: str) -> list[str]:
    """Non-comment lines of a key file that only its owner may read."""
    file = Path(path)
    mode = stat.S_IMODE(file.stat().st_mode)
    if mode & 0o077:
        raise ValueError(f"{flag} {file} is readable by others (mode {mode:o}); `chmod 600 {file}`.")
    lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ValueError(f"{flag} {file} holds no key.")
    return keys


def _client_keys(path: str | None) -> list[str]:
    if path is not None:
        return _private_lines(path, "--api-key-file")
    return [key for key in (env.get("WEFT_API_KEY") or "").split(",") if key]


def _draining_server(config, proxy: PDProxy):
    """uvicorn's server, telling the proxy to refuse new requests once a signal stops it
    (uvicorn then closes its listeners and waits ``timeout_graceful_shutdown`` for the rest)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            proxy.draining = True
            logger.info("Draining: requests in flight have %ss to finish.", config.timeout_graceful_shutdown)
            await super().shutdown(sockets)

    return DrainingServer(config)


def main(argv: list[str]) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        proxy = PDProxy(
            BackendPool(args.prefill, args.policy),
            BackendPool(args.decode, args.policy),
            secret=trust.load_secret(args.kv_transfer_secret_file),
            max_body_bytes=args.max_request_body_bytes,
            read_timeout_s=args.backend_read_timeout,
            api_keys=_client_keys(args.api_key_file),
            backend_key=None
            if args.backend_api_key_file is None
            else _private_lines(args.backend_api_key_file, "--backend-api-key-file")[0],
            body_timeout_s=args.body_timeout,
        )
        if args.max_connections < 1 or not args.keep_alive_timeout > 0 or not args.shutdown_timeout >= 0:
            raise ValueError(
                "--max-connections must be at least 1, --keep-alive-timeout positive and "
                "--shutdown-timeout not negative."
            )
        if proxy.secret is None:
            logger.warning(
                "No --kv-transfer-secret-file (nor $%s): P/D servers refuse this proxy's KV "
                "transfer parameters, so every prompt is computed on the decode server.",
                trust.ENV,
            )
    except (ValueError, OSError) as e:
        print(f"weft pd-proxy: {e}", file=sys.stderr)
        return 2
    logger.info("P/D proxy: prefill %s, decode %s (%s)", proxy.prefill.urls, proxy.decode.urls, args.policy)
    from services.api.slow_clients import header_deadline_protocol

    config = uvicorn.Config(
        build_app(proxy),
        host=args.host,
        port=args.port,
        loop="uvloop",
        log_level="warning",
        limit_concurrency=args.max_connections,
        timeout_keep_alive=args.keep_alive_timeout,
        timeout_graceful_shutdown=max(1, round(args.shutdown_timeout)),
        http=header_deadline_protocol(args.body_timeout),
    )
    server = _draining_server(config, proxy)
    # uvicorn re-raises the signal it stopped for with the handlers it found: make those its
    # own, so the proxy exits 0 after a drain rather than dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    server.run()
    return 0
