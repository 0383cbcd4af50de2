"""Pausing generation: the hook RL loops use around a weight update.

``PausableEngineClient`` wraps the engine client every route uses. While
paused, a new request waits here, before reaching any engine, until
``resume`` (vLLM does the same: pause blocks new requests), and the engines
schedule nothing. What happens to the requests already running is the
pause's ``mode``:

- ``abort``: they are aborted at once (finish reason ``abort``);
- ``wait``: the pause returns once they have all finished;
- ``keep``: they stay where they are, KV blocks and all, frozen, and carry
  on from there after ``resume``.

Then, with ``clear_cache``, every rank's prefix cache is reset (refused,
and reported, while a kept request holds blocks).

A held request waits at most ``hold_timeout_s`` (``--pause-hold-timeout``):
past it, it fails as "no engine can take it" (503), so a pause nobody
resumes does not hold clients for ever.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncGenerator

from protocol import EngineCoreOutput, EngineCoreRequest
from protocol.engine import UtilityMethod
from services.api.engine_client import EngineClient, EngineNotReadyError, RankStats

DEFAULT_HOLD_TIMEOUT_S = 600.0


class PauseMode(enum.StrEnum):
    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


class PausableEngineClient(EngineClient):
    def __init__(self, inner: EngineClient, hold_timeout_s: float | None = DEFAULT_HOLD_TIMEOUT_S) -> None:
        self.inner = inner
        self.hold_timeout_s = hold_timeout_s
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._in_flight: set[str] = set()  # engine requests past the gate
        self.num_held = 0  # engine requests waiting at the gate
        self._idle = asyncio.Event()
        self._idle.set()
        self._pausing = asyncio.Lock()

    @property
    def is_paused(self) -> bool:
        return not self._resumed.is_set()

    async def pause(self, mode: PauseMode, clear_cache: bool) -> bool | None:
        """Pause; returns whether every rank's prefix cache was reset (None: not asked)."""
        async with self._pausing:
            self._resumed.clear()
            if mode is PauseMode.ABORT:
                await self.inner.abort(sorted(self._in_flight))
            elif mode is PauseMode.WAIT:
                await self._idle.wait()
            if not self.is_paused:
                return None  # resumed while it waited: nothing to pause any more
            await self.inner.call_utility(UtilityMethod.PAUSE)
            if not clear_cache:
                return None
            return all((await self.inner.call_utility(UtilityMethod.RESET_PREFIX_CACHE)).values())

    async def resume(self) -> None:
        await self.inner.call_utility(UtilityMethod.RESUME)
        self._resumed.set()

    # ---- EngineClient, delegated; generate waits at the gate

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        if not self._resumed.is_set():
            self.num_held += 1
            try:
                await asyncio.wait_for(self._resumed.wait(), self.hold_timeout_s)
            except TimeoutError:
                raise EngineNotReadyError(
                    f"Generation is paused, and the request waited {self.hold_timeout_s:g} s for a resume."
                ) from None
            finally:
                self.num_held -= 1
        self._in_flight.add(request.request_id)
        self._idle.clear()
        outputs = self.inner.generate(request)
        try:
            async for output in outputs:
                yield output
        finally:
            self._in_flight.discard(request.request_id)
            if not self._in_flight:
                self._idle.set()
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()  # closed early: the inner client aborts the request

    async def start(self) -> None:
        await self.inner.start()

    async def shutdown(self) -> None:
        self._resumed.set()  # held requests go on to fail on the stopped engines, not hang
        await self.inner.shutdown()

    async def abort(self, request_ids: list[str]) -> None:
        await self.inner.abort(request_ids)

    @property
    def ready(self) -> bool:
        return self.inner.ready

    def rank_stats(self) -> dict[int, RankStats]:
        return self.inner.rank_stats()

    @property
    def max_model_len(self) -> int | None:
        return self.inner.max_model_len

    @property
    def start_failure(self) -> str | None:
        return self.inner.start_failure

    def dropped_frames(self) -> dict[str, int]:
        return self.inner.dropped_frames()

    async def call_utility(self, method: UtilityMethod) -> dict[int, bool]:
        return await self.inner.call_utility(method)
