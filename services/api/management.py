"""Management routes that operators and RL loops script against (vLLM's names).

- ``GET /load``: ``{"server_load": n}``, the generation requests in flight
  (held while paused included).
- ``POST /pause?mode=abort|wait|keep&clear_cache=true|false`` (or vLLM's
  earlier ``wait_for_inflight_requests=true|false``) and
  ``POST /resume``: generation stops and starts (``services.api.pausable``);
  ``GET /is_paused``.
- ``POST /reset_prefix_cache``: every rank forgets its cached prefixes;
  409 while a rank has KV blocks in use (as vLLM, nothing is reset then on
  that rank), so a caller pauses first or retries when idle.
- ``GET /v1/models/{model}``: one model card, a 404 for a name not served.

The POST routes change serving for every user: they need the admin key
(``--admin-api-key``), never a tenant's ``--api-key``, and answer 403 on a
server started without one; the GET ones stay open, like /health.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol.engine import UtilityMethod
from services.api.admission import Admission
from services.api.auth import bearer_match, key_digests
from services.api.engine_client import EngineDeadError, EngineNotReadyError
from services.api.errors import APIError, bad_request
from services.api.pausable import PausableEngineClient, PauseMode
from services.env import get as env_get

MANAGEMENT_PATHS = ("/pause", "/resume", "/reset_prefix_cache")

_BOOLS = {"true": True, "false": False}
T = TypeVar("T")
Handler = Callable[["ManagementRoutes", Request], Awaitable[Response]]


def add_admin_args(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--admin-api-key",
        action="append",
        default=None,
        help="The key the management POSTs (/pause, /resume, /reset_prefix_cache) need, as "
        "'Authorization: Bearer KEY'; tenants' --api-key keys do not open them; without an admin "
        "key they answer 403 (default: $WEFT_ADMIN_API_KEY, comma-separated; none). A key here shows "
        "in `ps`: prefer --admin-api-key-file or the environment variable.",
    )
    group.add_argument(
        "--admin-api-key-file",
        default=None,
        metavar="PATH",
        help="Read the admin keys from this file, one per line (#-comments allowed; default: none).",
    )


def admin_api_keys(args: argparse.Namespace) -> list[str]:
    """--admin-api-key and --admin-api-key-file together; only without either, $WEFT_ADMIN_API_KEY."""
    if any(not key for key in args.admin_api_key or ()):
        raise ValueError("--admin-api-key must not be empty.")
    keys = list(args.admin_api_key or [])
    if args.admin_api_key_file is not None:
        with open(args.admin_api_key_file, encoding="utf-8") as f:
            in_file = [line.strip() for line in f]
        in_file = [key for key in in_file if key and not key.startswith("#")]
        if not in_file:
            raise ValueError(f"--admin-api-key-file {args.admin_api_key_file} holds no key.")
        keys += in_file
    if args.admin_api_key or args.admin_api_key_file is not None:
        return keys
    return [key for key in (env_get("WEFT_ADMIN_API_KEY") or "").split(",") if key]


def _query(request: Request, allowed: dict[str, str]) -> dict[str, str]:
    """The query parameters, with defaults; 400 for an unknown or repeated one."""
    params = request.query_params
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise bad_request(
            f"Unknown query parameter(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}.",
            unknown[0],
        )
    for name in params:
        if len(params.getlist(name)) > 1:
            raise bad_request(f"Query parameter `{name}` is given more than once.", name)
    return {name: params.get(name, default) for name, default in allowed.items()}


def _choice(value: str, name: str, choices: Mapping[str, T]) -> T:
    if value not in choices:
        raise bad_request(f"`{name}` must be one of {', '.join(choices)}, got {value!r}.", name)
    return choices[value]


def _pause_mode(mode: str, wait_for_inflight: str) -> PauseMode:
    """``mode``, or vLLM's earlier ``wait_for_inflight_requests`` (true: wait,
    false: abort); by default abort, as vLLM."""
    if mode and wait_for_inflight:
        raise bad_request(
            "Give `mode` or `wait_for_inflight_requests`, not both.", "wait_for_inflight_requests"
        )
    if wait_for_inflight:
        wait = _choice(wait_for_inflight, "wait_for_inflight_requests", _BOOLS)
        return PauseMode.WAIT if wait else PauseMode.ABORT
    return _choice(mode or PauseMode.ABORT.value, "mode", {m.value: m for m in PauseMode})


async def _engines(call: Awaitable[T]) -> T:
    """Await an engine-wide call; engine trouble is a 5xx, never a client error."""
    try:
        return await call
    except (EngineNotReadyError, EngineDeadError) as e:
        raise APIError(str(e), 503, headers={"Retry-After": "5"}) from e
    except TimeoutError as e:
        raise APIError("The engines did not answer in time.", 504) from e
    except RuntimeError as e:
        raise APIError(str(e), 500) from e


def _admin_only(handler: Handler) -> Handler:
    """The route needs the admin key: 403 on a server without one, 401 for a missing or wrong key."""

    async def endpoint(self: ManagementRoutes, request: Request) -> Response:
        if not self._admin_digests:
            raise APIError(
                "Management routes are off: start the server with --admin-api-key to use them.", 403
            )
        if bearer_match(request.headers.get("authorization", ""), self._admin_digests) is None:
            raise APIError(
                "This route needs the admin key: send `Authorization: Bearer <admin key>`.",
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(self, request)

    return endpoint


class ManagementRoutes:
    def __init__(
        self,
        client: PausableEngineClient,
        admission: Admission,
        model_card: Callable[[str], dict[str, object] | None],
        admin_keys: Sequence[str] = (),
    ) -> None:
        self.client = client
        self.admission = admission
        self.model_card = model_card
        if not all(admin_keys):
            raise ValueError("Admin API keys must be non-empty strings.")
        self._admin_digests = key_digests(admin_keys)

    async def load(self, request: Request) -> Response:
        _query(request, {})
        return JSONResponse({"server_load": self.admission.num_requests})

    @_admin_only
    async def pause(self, request: Request) -> Response:
        query = _query(request, {"mode": "", "clear_cache": "true", "wait_for_inflight_requests": ""})
        mode = _pause_mode(query["mode"], query["wait_for_inflight_requests"])
        clear_cache = _choice(query["clear_cache"], "clear_cache", _BOOLS)
        cleared = await _engines(self.client.pause(mode, clear_cache))
        return JSONResponse(
            {"is_paused": self.client.is_paused, "mode": mode.value, "cache_cleared": cleared}
        )

    @_admin_only
    async def resume(self, request: Request) -> Response:
        _query(request, {})
        await _engines(self.client.resume())
        return JSONResponse({"is_paused": self.client.is_paused})

    async def is_paused(self, request: Request) -> Response:
        _query(request, {})
        return JSONResponse({"is_paused": self.client.is_paused})

    @_admin_only
    async def reset_prefix_cache(self, request: Request) -> Response:
        _query(request, {})
        results = await _engines(self.client.call_utility(UtilityMethod.RESET_PREFIX_CACHE))
        refused = sorted(rank for rank, ok in results.items() if not ok)
        if refused:
            raise APIError(
                f"The prefix cache of rank(s) {refused} was not reset: their KV blocks are in use "
                f"by requests. Retry when idle, or POST /pause?mode=wait first.",
                409,
            )
        return JSONResponse({"reset": True, "ranks": sorted(results)})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        card = self.model_card(name)
        if card is None:
            raise APIError(f"The model `{name}` does not exist.", 404, "model")
        return JSONResponse(card)

    def table(self) -> list[Route]:
        return [
            Route("/load", self.load, methods=["GET"]),
            Route("/pause", self.pause, methods=["POST"]),
            Route("/resume", self.resume, methods=["POST"]),
            Route("/is_paused", self.is_paused, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
        ]
