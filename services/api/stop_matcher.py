"""Finding the first stop string in a request's text, in one pass.

Checking each stop string with ``str.find`` costs the number of stop
strings on every new token, per choice. An Aho-Corasick automaton
(pyahocorasick, in C) finds every stop string that occurs in one scan of the
text, whatever their number; the caller only scans the window where a new
match can be (the new text plus the longest stop string's length). One
request's choices share one automaton: it is built once per stop list.
"""

from __future__ import annotations

import functools

import ahocorasick


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.max_len = max(map(len, stops), default=0)
        self._automaton = ahocorasick.Automaton() if stops else None
        if self._automaton is not None:
            for stop in stops:
                self._automaton.add_word(stop, stop)
            self._automaton.make_automaton()

    def __bool__(self) -> bool:
        return self._automaton is not None

    def earliest(self, text: str, start: int) -> tuple[int, str] | None:
        """(index, stop) of the stop string that begins first at or after
        ``start`` (the shortest of those beginning there), or None."""
        if self._automaton is None:
            return None
        best: tuple[int, str] | None = None
        for end, stop in self._automaton.iter(text, start):
            if best is not None and end - self.max_len + 1 > best[0]:
                break  # matches come by end index: none further on can begin earlier
            candidate = (end - len(stop) + 1, stop)
            if best is None or candidate < best:
                best = candidate
        return best


@functools.lru_cache(maxsize=256)
def matcher_for(stops: tuple[str, ...]) -> StopMatcher:
    """The matcher of ``stops``, shared by every choice (and request) with the same list."""
    return StopMatcher(stops)
