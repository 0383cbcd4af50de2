"""How many torch threads a CPU step runs on: one for a step of a few tokens.

A step of a few tokens is about 200 parallel regions (matmuls, attention,
norms) of a few microseconds of work each, and handing each to a second
OpenMP thread costs about as much as the work. Measured on the 2-core
machine with `weft bench latency --num-threads 1|2` (README, "Threads per
step"): batch-1 decode 15.2 ms a token on one thread against 23.1 on two,
batch 8 37.5 against 40.0, level at 16, and from there on two threads win
(batch 64: 1.45x, a 64 x 32-token prefill 2.0x). So a step of fewer than
``one_thread_max_tokens()`` tokens runs on one thread, any other on the
worker's ``num_threads``.

The count is set in the thread that runs the forward (OpenMP keeps it per
thread; async scheduling runs the forward on a thread of its own).
"""

from __future__ import annotations

import torch

from services import env

DEFAULT_FEW_TOKENS = 16


def few_tokens() -> int:
    """``WEFT_CPU_ONE_THREAD_BELOW`` (tokens; 0: never one thread), default 16."""
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
