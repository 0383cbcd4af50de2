"""Admission control and the drain on shutdown.

Each ready rank takes at most ``max_num_seqs`` running plus
``max_waiting_requests`` waiting engine requests (1,024 by default, fewer
where that many would not fit in memory): as in vLLM, requests past the
running batch wait in the engine's queue. The API admits a request (its
prompts x ``n`` engine requests) only while the ready ranks have room for all
of them together, and answers 503 with ``Retry-After`` otherwise, so a flood
gets a quick "try again" instead of a queue that grows without end.
The count is the API's own (requests admitted and not yet ended), never a
stale load report, so it is exact at the moment of the decision.

Every admitted request holds a ``Ticket``; ``TicketReleaseMiddleware``
returns it when the HTTP exchange ends, however it ends (finished, failed,
client gone before the first byte), so no slot ever leaks.

On shutdown ``drain`` refuses new requests, waits for the admitted ones up to
a timeout, then fails those still running with a clear 503 error (an error
event for streams), which aborts them in the engines.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.engine_client import EngineClient
from services.api.errors import APIError, bad_request, unavailable
from services.api.limits import ServingLimits

logger = logging.getLogger(__name__)

_SCOPE_KEY = "weft.tickets"
_RETRY_OVERLOADED_S = 1
_RETRY_UNAVAILABLE_S = 5


class _Failable(Protocol):
    def fail(self, error: BaseException) -> None: ...


class Ticket:
    """``n`` admitted engine requests; ``release`` gives them back (once)."""

    __slots__ = ("n", "runner", "_admission")

    def __init__(self, admission: Admission, n: int) -> None:
        self.n = n
        self.runner: _Failable | None = None  # set once the runner exists, so a drain can stop it
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission._release(self)
            self._admission = None


class Admission:
    def __init__(self, engine_client: EngineClient, max_num_seqs: int, limits: ServingLimits) -> None:
        self.engine_client = engine_client
        self.per_rank = max_num_seqs + limits.waiting_per_rank()
        self.draining = False
        self.in_use = 0  # engine requests admitted and not yet released
        self.num_rejected = {"overloaded": 0, "not_ready": 0, "shutting_down": 0}
        self._tickets: set[Ticket] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_requests(self) -> int:
        """HTTP requests holding a ticket: admitted and not yet answered (vLLM's server load)."""
        return len(self._tickets)

    def capacity(self) -> int:
        ready = sum(s.state == "ready" for s in self.engine_client.rank_stats().values())
        return ready * self.per_rank

    def admit(self, n: int) -> Ticket:
        """A ticket for ``n`` engine requests, or the APIError saying why not."""
        if self.draining:
            self.num_rejected["shutting_down"] += 1
            raise unavailable("The server is shutting down.", _RETRY_UNAVAILABLE_S)
        capacity = self.capacity()
        if capacity == 0:
            self.num_rejected["not_ready"] += 1
            raise unavailable("No engine is ready to serve requests; try again later.", _RETRY_UNAVAILABLE_S)
        if n > self.per_rank:
            raise bad_request(
                f"This request needs {n} sequences (prompts x n), more than one engine "
                f"takes at once ({self.per_rank}).",
                "n",
            )
        if self.in_use + n > capacity:
            self.num_rejected["overloaded"] += 1
            raise unavailable(
                f"The server is overloaded ({self.in_use} sequences admitted, room for "
                f"{capacity}); retry later.",
                _RETRY_OVERLOADED_S,
            )
        ticket = Ticket(self, n)
        self._tickets.add(ticket)
        self.in_use += n
        self._idle.clear()
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)
        self.in_use -= ticket.n
        assert self.in_use >= 0, "a ticket was released twice"
        if not self._tickets:
            self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, give the admitted ones ``timeout_s`` to end,
        then fail the rest; returns how many were failed."""
        self.draining = True
        logger.info("Draining: %d request(s) in flight get %.0fs to finish.", len(self._tickets), timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except TimeoutError:
            pass
        stopped = [t.runner for t in self._tickets if t.runner is not None]
        logger.warning("Shutdown timeout: stopping %d request(s) still running.", len(stopped))
        for runner in stopped:
            runner.fail(shutting_down_error())
        return len(stopped)


def shutting_down_error() -> APIError:
    return unavailable(
        "The server is shutting down; this request was stopped before it finished.", _RETRY_UNAVAILABLE_S
    )


def hold_ticket(scope: Scope, ticket: Ticket, runner: _Failable) -> None:
    """Tie ``ticket`` to this HTTP exchange (released when it ends) and to ``runner``."""
    ticket.runner = runner
    scope.setdefault(_SCOPE_KEY, []).append(ticket)


class TicketReleaseMiddleware:
    """Releases the tickets of an HTTP exchange when the app is done with it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            for ticket in scope.pop(_SCOPE_KEY, ()):
                ticket.release()
