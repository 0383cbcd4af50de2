"""How a serving engine core stops gracefully: announce, finish what it holds, go.

The first SIGTERM (or SIGINT) on a serving engine starts a drain: the input
thread tells the API (``EngineDraining``), the API stops routing to this rank
and answers with a DRAIN frame, and the busy loop keeps stepping until it has
no unfinished request left -- then the engine says goodbye and exits. If
that takes longer than ``timeout_s``, it stops anyway and the API fails the
requests still held with a clear error. A second signal stops at once, and
so does the first one while the engine is still starting (nothing to drain).

Waiting for the API's DRAIN frame, not only for an empty scheduler, closes a
race: an ADD the API sent just before it saw the notice is queued before the
DRAIN frame on the same ordered link, so it is served, not dropped.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class Drain:
    def __init__(self, stop: threading.Event, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be non-negative, got {timeout_s}.")
        self.stop = stop
        self.timeout_s = timeout_s
        self.requested = threading.Event()
        self.announced = False  # the input thread sent EngineDraining
        self.acknowledged = False  # the busy loop reached the API's DRAIN frame
        self._serving = False
        self._deadline = float("inf")

    def begin_serving(self) -> None:
        self._serving = True

    def on_signal(self, *_: object) -> None:
        """Signal handler: drain if serving, else (or the second time) stop now."""
        if not self._serving or self.requested.is_set():
            self.stop.set()
            return
        self._deadline = time.monotonic() + self.timeout_s
        self.requested.set()
        logger.info(
            "Draining: finishing the requests held (at most %.0fs); signal again to stop now.", self.timeout_s
        )

    def stop_reason(self, num_unfinished: int) -> str | None:
        """Why the busy loop should stop now, or None to keep serving."""
        if not self.requested.is_set():
            return None
        if self.acknowledged and num_unfinished == 0:
            return "drained"
        if time.monotonic() >= self._deadline:
            return f"drain timed out after {self.timeout_s:g}s with {num_unfinished} request(s) unfinished"
        return None
