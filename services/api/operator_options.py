"""What an operator sets around the API (``weft serve`` flags, vLLM's names): CORS, TLS, a root
path behind a path-prefix proxy, the log format and OpenTelemetry traces.

``OperatorOptions`` is what ``build_app`` needs of them (the middleware it puts in front of
everything else); ``tls_options`` is what uvicorn needs. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import ssl
from dataclasses import dataclass
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.request_id import RequestIdMiddleware
from services.log_format import add_log_format_arg

_ROOT_PATH = re.compile(r"(/[A-Za-z0-9._~-]+)+")


@dataclass(frozen=True)
class OperatorOptions:
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    otlp_traces_endpoint: str | None = None


def add_operator_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("operations (CORS, TLS, proxies, logs, traces)")
    group.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=[],
        help="Origins whose browser pages may call the API (CORS): a JSON list as vLLM takes it, or "
        'comma-separated; "*" for any (default: none; a preflight from another origin gets 400).',
    )
    group.add_argument(
        "--allowed-methods",
        type=_string_list,
        default=["*"],
        help="HTTP methods those pages may use (CORS; default: all).",
    )
    group.add_argument(
        "--allowed-headers",
        type=_string_list,
        default=["*"],
        help="Request headers those pages may send (CORS; default: all).",
    )
    group.add_argument(
        "--allow-credentials",
        action="store_true",
        help="Let those pages send cookies and HTTP authentication (CORS; default: off).",
    )
    group.add_argument(
        "--ssl-keyfile", default=None, help="TLS: the server's private key (PEM; default: none, plain HTTP)."
    )
    group.add_argument(
        "--ssl-certfile",
        default=None,
        help="TLS: the server's certificate chain (PEM; default: none, plain HTTP).",
    )
    group.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="TLS: CA certificates (PEM) that client certificates are checked against (with --ssl-cert-reqs; "
        "default: none).",
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)),
        default=int(ssl.CERT_NONE),
        help="TLS client certificates: 0 not asked, 1 checked if sent, 2 required (Python's "
        "ssl.CERT_*; default: %(default)s).",
    )
    group.add_argument(
        "--root-path",
        default="",
        help="The path prefix a proxy serves the API under (/weft): routes answer with and without it, "
        "and /docs and /openapi.json name it (default: none).",
    )
    add_log_format_arg(group)
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="Send an OpenTelemetry span per request (queue, prefill and decode times) over OTLP/HTTP "
        "to this collector URL (http://HOST:4318 or .../v1/traces; needs pip install 'weft[otel]'; "
        "default: off).",
    )


def _string_list(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def operator_options(args: argparse.Namespace) -> OperatorOptions:
    """The options the flags set; ValueError for a bad root path or traces endpoint."""
    root = args.root_path.rstrip("/")
    if root and not _ROOT_PATH.fullmatch(root):
        raise ValueError(
            f"--root-path must be a path like /weft (letters, digits, ._~-), got {args.root_path!r}."
        )
    if args.otlp_traces_endpoint is not None:
        from services.api.tracing import check_available, traces_url

        traces_url(args.otlp_traces_endpoint)
        check_available()
    return OperatorOptions(
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        root_path=root,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's TLS settings; ValueError for a half-given or unreadable set."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together.")
    if args.ssl_certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile.")
        return {}
    if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs to check client certificates against.")
    for flag, path in (
        ("--ssl-keyfile", args.ssl_keyfile),
        ("--ssl-certfile", args.ssl_certfile),
        ("--ssl-ca-certs", args.ssl_ca_certs),
    ):
        if path is not None and not os.access(path, os.R_OK):
            raise ValueError(f"{flag} {path} is not a readable file.")
    options: dict[str, Any] = {
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }
    if args.ssl_ca_certs is not None:
        options["ssl_ca_certs"] = args.ssl_ca_certs
    return options


class RootPathMiddleware:
    """Behind a proxy that serves the API under ``root_path``: a path under it loses the prefix,
    one without it (a proxy that strips it) stays; ``scope["root_path"]`` records it either way.
    What runs inside sees the same paths as without a root path (the key check included)."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = dict(scope)
            path, root = scope["path"], self.root_path
            if path == root or path.startswith(root + "/"):
                scope["path"] = path[len(root) :] or "/"
                raw = scope.get("raw_path")
                if raw is not None and raw.startswith(root.encode()):
                    scope["raw_path"] = raw[len(root) :] or b"/"
            scope["root_path"] = root
        await self.app(scope, receive, send)


def operator_middleware(options: OperatorOptions, tracing: bool) -> list[Middleware]:
    """Outermost first: the root path comes off, CORS answers preflights (before any key check),
    every exchange gets its X-Request-Id, and (with tracing) the client's trace context is kept."""
    middleware = []
    if options.root_path:
        middleware.append(Middleware(RootPathMiddleware, root_path=options.root_path))
    middleware += [
        Middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers),
            allow_credentials=options.allow_credentials,
            expose_headers=["X-Request-Id"],
        ),
        Middleware(RequestIdMiddleware),
    ]
    if tracing:
        from services.api.tracing import TraceParentMiddleware

        middleware.append(Middleware(TraceParentMiddleware))
    return middleware
