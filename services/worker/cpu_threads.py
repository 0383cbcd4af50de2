"""How many torch threads a CPU step runs on: all of the worker's, unless asked otherwise.

A step is about 200-300 parallel regions (matmuls, attention, norms), many
of a few microseconds of work each. While OpenMP's threads slept after every
region (``OMP_WAIT_POLICY=PASSIVE`` with no spin), waking the second thread
cost about as much as that work, and a step of a few tokens ran faster on one
thread (batch-1 decode 15.2 ms a token against 23.1 on two, 2026-12-01). With
the short spin weft now sets (``services/__init__.py``: ``GOMP_SPINCOUNT``) the
second thread stays awake between a step's regions, and two threads won at
every batch size measured (`weft bench latency --num-threads 1|2`, README
"Threads per step": batch 1 12.6 against 17.3 ms a token, batch 8 23.5
against 39.3). So by default every step runs on the worker's ``num_threads``;
``WEFT_CPU_ONE_THREAD_BELOW=N`` puts a step of fewer than N tokens on one
thread (for a run with passive waiting and no spin, where it still pays).

The count is set in the thread that runs the forward (OpenMP keeps it per
thread; async scheduling runs the forward on a thread of its own).
"""

from __future__ import annotations

import torch

from services import env

DEFAULT_FEW_TOKENS = 0


def few_tokens() -> int:
    """``WEFT_CPU_ONE_THREAD_BELOW`` (tokens; 0: never one thread), default 0."""
    raw = (env.get("WEFT_CPU_ONE_THREAD_BELOW") or "").strip()
    if not raw:
        return DEFAULT_FEW_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"WEFT_CPU_ONE_THREAD_BELOW must be a token count >= 0, got {raw!r}.")
    return value


class StepThreads:
    """Sets torch's thread count for each step from its token count (CPU only)."""

    def __init__(self, num_threads: int, few: int | None = None) -> None:
        self.num_threads = num_threads
        self.few = few_tokens() if few is None else few

    def threads_for(self, num_tokens: int) -> int:
        return 1 if num_tokens < self.few else self.num_threads

    def enter_step(self, num_tokens: int) -> None:
        want = self.threads_for(num_tokens)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
