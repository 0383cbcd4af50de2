"""Faults a test can make a worker suffer inside a step, through ``WEFT_TEST_FAULT_FILE``.

Unset (always, outside tests) this costs nothing: ``FaultInjector.from_env``
returns None and the worker never calls it. Set, the worker reads the named
file before each step (a missing file: no fault), so a test turns a fault on
and off while the stack runs:

- ``hang``: the step sleeps until the file changes or disappears (a stuck
  worker, or a tensor-parallel rank stuck in a collective, as the driver's
  ``_collect`` sees it);
- ``oom N``: a step that schedules more than ``N`` tokens for one request
  fails with an allocation error, as a prompt too large for memory does.
"""

from __future__ import annotations

import time
from pathlib import Path

from protocol import SchedulerOutput
from services import env

_POLL_S = 0.05


class InjectedAllocationError(MemoryError):
    """What the ``oom`` fault raises: an allocation that failed."""


class FaultInjector:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        path = env.get("WEFT_TEST_FAULT_FILE")
        return None if path is None else cls(Path(path))

    def _fault(self) -> str:
        try:
            return self.path.read_text().strip()
        except OSError:
            return ""

    def before_step(self, scheduler_output: SchedulerOutput) -> None:
        fault = self._fault()
        if fault == "hang":
            while self._fault() == "hang":
                time.sleep(_POLL_S)
        elif fault.startswith("oom "):
            limit = int(fault.split()[1])
            largest = max(scheduler_output.num_scheduled_tokens.values(), default=0)
            if largest > limit:
                raise InjectedAllocationError(
                    f"injected: cannot allocate the activations of {largest} tokens (more than {limit})"
                )
