"""A deadline for a request's headers: the part of a slow client the app never sees.

uvicorn closes a keep-alive connection that stays idle after a response,
but not one that sends nothing after connecting, nor one whose headers
arrive a byte at a time: each holds a connection (one of
``--max-connections``) for as long as the client likes. This h11 protocol
closes a connection whose next request has not begun (its headers complete)
``timeout_s`` after the connection opened or its last response went out.
The body's own deadline is the app's (``BodyDeadlineMiddleware``).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderDeadlineH11Protocol(H11Protocol):
    header_timeout_s: float = 30.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()  # no timer outlives its connection
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        # A new request replaces self.cycle: if it is still the one seen now, none began.
        waiting_on = self.cycle
        self._header_deadline = self.loop.call_later(
            self.header_timeout_s, self._close_if_still_waiting, waiting_on
        )

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _close_if_still_waiting(self, waiting_on: object) -> None:
        if self.cycle is waiting_on and not self.transport.is_closing():
            self.timeout_keep_alive_handler()  # uvicorn's own way to drop an idle connection


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's ``http`` protocol class, closing connections whose headers take over ``timeout_s``."""
    return type("HeaderDeadlineH11Protocol", (_HeaderDeadlineH11Protocol,), {"header_timeout_s": timeout_s})
