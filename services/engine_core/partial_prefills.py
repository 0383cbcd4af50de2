"""Concurrent partial prefills: vLLM's ``max_num_partial_prefills`` and
``max_long_partial_prefills``.

A prefill is *partial* in a step when the step leaves some of its prompt for
later, and *long* when more than ``long_prefill_token_threshold`` of its tokens
are left as the step starts (a long prefill is always partial: the threshold
caps its chunk). With ``max_num_partial_prefills`` above 1, a step carries at
most that many partial prefills and at most ``max_long_partial_prefills`` long
ones; a waiting prompt that would go over either limit is passed over for this
step, so a short prompt queued behind a long one starts first and reaches its
first token while the long one is still being prefilled. Prefills already
running are never held back, so a long prompt that started keeps its pace.
With the default of 1 none of this applies: admission is strictly in queue order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartialPrefillLimits:
    max_partial: int
    max_long: int
    long_threshold: int  # tokens left above which a prefill is long; 0 means none is

    @property
    def enabled(self) -> bool:
        return self.max_partial > 1

    def is_long(self, num_left: int) -> bool:
        return self.long_threshold > 0 and num_left > self.long_threshold


@dataclass
class PrefillCount:
    """The partial and long prefills one step carries so far."""

    limits: PartialPrefillLimits
    num_partial: int = 0
    num_long: int = 0

    def admits(self, num_left: int, num_new: int) -> bool:
        """Whether a waiting prompt with ``num_left`` tokens to compute may
        start with ``num_new`` of them in this step."""
        if not self.limits.enabled:
            return True
        if num_new < num_left and self.num_partial >= self.limits.max_partial:
            return False
        return not (self.limits.is_long(num_left) and self.num_long >= self.limits.max_long)

    def add(self, num_left: int, num_new: int) -> None:
        """Count a prefill the step carries (a decode, with one token left, is none)."""
        if num_left <= 1:
            return
        self.num_partial += num_new < num_left
        self.num_long += self.limits.is_long(num_left)
