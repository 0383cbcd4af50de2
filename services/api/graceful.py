"""Serving the app on uvicorn, with a graceful stop on SIGTERM or SIGINT.

uvicorn alone, on a signal, closes its listeners and waits for open
connections, then cancels whatever still runs -- a stream cut mid-way with
no word of why. ``GracefulServer`` runs weft's drain beside that wait: new
requests get 503, admitted ones have ``shutdown_timeout_s`` to finish, then
those still running end with a clear error (a 503 body, or an error event
and ``[DONE]`` for streams). Only then does the app's lifespan stop the
engine cores. A second SIGINT still forces an immediate exit. An engine
core that fails before it ever served stops the server the same way
(``EngineClient.start_failure``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette

from services.api.admission import Admission

logger = logging.getLogger(__name__)

# After the drain failed the stragglers, how long their responses may take to
# go out before uvicorn cancels them anyway.
_FLUSH_GRACE_S = 10.0


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        admission: Admission,
        shutdown_timeout_s: float,
        start_failure: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``start_failure``: why an engine failed before it ever served, which stops the server."""
        config.timeout_graceful_shutdown = int(shutdown_timeout_s + _FLUSH_GRACE_S)
        super().__init__(config)
        self.admission = admission
        self.shutdown_timeout_s = shutdown_timeout_s
        self._start_failure = start_failure
        self._drain: asyncio.Task[int] | None = None

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self._start_failure() is not None:
            logger.error("Stopping: an engine core failed to start.")
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._drain = asyncio.create_task(self.admission.drain(self.shutdown_timeout_s), name="drain")
        await asyncio.sleep(0)  # the drain refuses new requests from here on
        try:
            await super().shutdown(sockets)  # stop accepting, wait for the open exchanges, lifespan
        finally:
            if not self._drain.done():
                self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)


def serve(
    app: Starlette,
    *,
    host: str,
    port: int,
    shutdown_timeout_s: float,
    log_level: str = "info",
    **uvicorn_options: Any,
) -> None:
    """Run ``app`` until SIGTERM/SIGINT, then stop gracefully; returns normally.
    ``uvicorn_options``: more ``uvicorn.Config`` settings (connection limits)."""
    config = uvicorn.Config(app, host=host, port=port, loop="uvloop", log_level=log_level, **uvicorn_options)
    engine_client = app.state.engine_client
    server = GracefulServer(
        config, app.state.admission, shutdown_timeout_s, lambda: engine_client.start_failure
    )
    # uvicorn re-raises the signal it stopped for once it is done, with the
    # handlers it found installed: make those ours, so the process then
    # returns (and its caller cleans up) instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    server.run()
