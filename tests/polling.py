"""Waiting on another process's state: poll with a deadline, fail with what was seen.

The one place tests sleep or keep a deadline: a process we do not own (an
HTTP server, an engine core) has no event to wait on, so we ask it again
after a short pause until the deadline passes. tests/repo/test_test_hygiene.py
keeps deadline loops out of the other test files.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import httpx


def wait_for(
    check: Callable[[], Any],
    timeout_s: float,
    what: str | Callable[[], str] = "the condition",
    interval_s: float = 0.1,
) -> Any:
    """Call ``check`` until it returns something truthy, and return that.

    ``what`` names the condition in the failure, or is called then to describe what was
    seen; ``interval_s=0`` for a ``check`` that blocks on its own (a socket poll).
    """
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {_describe(what)}")
        time.sleep(interval_s)
    return result


def keep_for(action: Callable[[], Any], duration_s: float) -> int:
    """Call ``action`` (which asserts what must keep holding, or blocks on what it reads)
    again and again for ``duration_s``; return how many times it ran."""
    deadline = time.monotonic() + duration_s
    runs = 0
    while time.monotonic() < deadline:
        action()
        runs += 1
    return runs


def _describe(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


async def wait_until(
    check: Callable[[], Any],
    timeout_s: float,
    what: str | Callable[[], str] = "the condition",
    interval_s: float = 0.05,
) -> Any:
    """``wait_for`` for a test running on the event loop; ``check`` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while not (result := await _maybe_await(check())):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {_describe(what)}")
        await asyncio.sleep(interval_s)
    return result


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def wait_healthy(
    url: str, timeout_s: float, check_alive: Callable[[], None], describe: Callable[[], str] = lambda: ""
) -> None:
    """Until ``url``/health answers 200; ``check_alive`` asserts the servers still run."""

    def healthy() -> bool:
        check_alive()
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(healthy, timeout_s, f"{url}/health", interval_s=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{describe()}") from None
