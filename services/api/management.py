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

The POST routes change serving for every user: with ``--api-key`` they need
the key (``MANAGEMENT_PATHS``); the GET ones stay open, like /health.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol.engine import UtilityMethod
from services.api.admission import Admission
from services.api.engine_client import EngineDeadError, EngineNotReadyError
from services.api.errors import APIError, bad_request
from services.api.pausable import PausableEngineClient, PauseMode

MANAGEMENT_PATHS = ("/pause", "/resume", "/reset_prefix_cache")

_BOOLS = {"true": True, "false": False}


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


def _choice(value: str, name: str, choices: dict[str, object]) -> object:
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


async def _engines(call):
    """Await an engine-wide call; engine trouble is a 5xx, never a client error."""
    try:
        return await call
    except (EngineNotReadyError, EngineDeadError) as e:
        raise APIError(str(e), 503, headers={"Retry-After": "5"}) from e
    except TimeoutError as e:
        raise APIError("The engines did not answer in time.", 504) from e
    except RuntimeError as e:
        raise APIError(str(e), 500) from e


class ManagementRoutes:
    def __init__(
        self, client: PausableEngineClient, admission: Admission, model_card: Callable[[str], dict | None]
    ) -> None:
        self.client = client
        self.admission = admission
        self.model_card = model_card

    async def load(self, request: Request) -> Response:
        _query(request, {})
        return JSONResponse({"server_load": self.admission.num_requests})

    async def pause(self, request: Request) -> Response:
        query = _query(request, {"mode": "", "clear_cache": "true", "wait_for_inflight_requests": ""})
        mode = _pause_mode(query["mode"], query["wait_for_inflight_requests"])
        clear_cache = _choice(query["clear_cache"], "clear_cache", _BOOLS)
        cleared = await _engines(self.client.pause(mode, clear_cache))
        return JSONResponse(
            {"is_paused": self.client.is_paused, "mode": mode.value, "cache_cleared": cleared}
        )

    async def resume(self, request: Request) -> Response:
        _query(request, {})
        await _engines(self.client.resume())
        return JSONResponse({"is_paused": self.client.is_paused})

    async def is_paused(self, request: Request) -> Response:
        _query(request, {})
        return JSONResponse({"is_paused": self.client.is_paused})

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
