"""The one-pass stop-string matcher: the same answers as checking each stop
string, in time that does not grow with how many there are."""

from __future__ import annotations

import random
import time

from protocol import SamplingParams
from services.api.detokenizer import IncrementalDetokenizer
from services.api.stop_matcher import StopMatcher, matcher_for
from tests.api.fake_engine_client import tokenizer


def naive_earliest(stops: list[str], text: str, start: int) -> tuple[int, str] | None:
    hits = [(text.find(s, start), s) for s in stops]
    hits = [(i, s) for i, s in hits if i >= 0]
    return min(hits) if hits else None


def test_agrees_with_checking_each_stop_string():
    rng = random.Random(0)
    for _ in range(3000):
        stops = list(
            {"".join(rng.choice("abé") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))}
        )
        text = "".join(rng.choice("abcé") for _ in range(rng.randint(0, 30)))
        start = rng.randint(0, len(text))
        assert StopMatcher(tuple(stops)).earliest(text, start) == naive_earliest(stops, text, start), (
            stops,
            text,
            start,
        )


def test_no_stops_match_nothing():
    matcher = StopMatcher(())
    assert not matcher and matcher.max_len == 0 and matcher.earliest("anything", 0) is None


def test_choices_share_one_matcher():
    assert matcher_for(("a", "b")) is matcher_for(("a", "b"))


def test_the_detokenizer_cuts_at_the_first_stop_string():
    tok = tokenizer()
    params = SamplingParams(stop=["fox", "quick brown", "zzz"], max_tokens=10)
    detok = IncrementalDetokenizer(tok, params)
    hit = False
    for token_id in tok.encode("The quick brown fox jumps", add_special_tokens=False):
        hit = detok.add_tokens([token_id])
        if hit:
            break
    assert hit and detok.stop_string == "quick brown" and detok.text == "The "


def _steps_times(matchers: list[StopMatcher], windows: list[str], repeats: int = 9) -> list[float]:
    """Each matcher's time to check each window the way the detokenizer does after each token:
    the best of ``repeats`` runs, taken in turns. The best, not the median: on a busy machine (a
    second test worker, other processes) a run that is preempted takes longer by the time it waited,
    and a longer run is preempted more often; the matchers in turns share the machine's moods."""
    best = [float("inf")] * len(matchers)
    for _ in range(repeats):
        for i, matcher in enumerate(matchers):
            start = time.perf_counter()
            for window in windows:
                matcher.earliest(window, 0)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def test_time_per_token_does_not_grow_with_the_number_of_stop_strings():
    rng = random.Random(1)
    alphabet = "abcdefgh "
    text = "".join(rng.choice(alphabet) for _ in range(20_000))
    length = 16
    # What each token's check looks at: its text and the length-1 characters before it.
    windows = [text[i : i + length + 3] for i in range(0, len(text) - length, 4)]
    # Stop strings of the text's own letters, so the scan walks into the automaton.
    few, many = (
        tuple({"".join(rng.choice(alphabet) for _ in range(length)) for _ in range(n)}) for n in (1, 1000)
    )
    # Checking each with str.find takes ~500x longer with 1000 than with one.
    many_s, few_s = _steps_times([StopMatcher(many), StopMatcher(few)], windows)
    assert many_s / few_s < 15
