"""The n-gram proposer: the longest tail found earlier, its most recent occurrence,
and what followed it (continued periodically when it runs into the tail)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from protocol import SpeculativeConfig
from services.worker.spec_decode.ngram import NgramProposer, propose_ngram


def drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int32), min_n, max_n, k).tolist()


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule spelled out as a plain scan (slow, obviously right)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # most recent first, excluding the tail itself
            if tokens[start : start + n] == tail:
                out, position = [], start + n
                extended = list(tokens)
                while len(out) < k:
                    out.append(extended[position])
                    extended.append(extended[position])  # the copy continues into what it proposed
                    position += 1
                return out
    return []


def test_copies_what_followed_the_tail() -> None:
    assert drafts([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]


def test_longer_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # [1,2,3,4] occurs earlier (ending at 7); [2,3,4] alone also ends at 3.
    assert drafts([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2) == [1, 2]
    # With max_n 3, the 3-gram [2,3,4] ends most recently at 7 as well.
    assert drafts([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 3, 2) == [1, 2]


def test_most_recent_occurrence_is_used() -> None:
    # [3] occurs at 1 (followed by 6, 2) and at 4 (followed by 4, 1).
    assert drafts([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2) == [4, 1]


def test_no_match_below_min_n() -> None:
    assert drafts([1, 2, 3, 4, 5, 3], 2, 4, 3) == []  # only the 1-gram [3] recurs
    assert drafts([1, 2, 3, 4, 5, 3], 1, 4, 3) == [4, 5, 3]
    assert drafts([5], 1, 3, 4) == []
    assert drafts([1, 2, 3, 4], 1, 3, 4) == []


def test_copy_continues_periodically_past_the_end() -> None:
    assert drafts([7, 7, 7, 7], 2, 2, 4) == [7, 7, 7, 7]
    # Period 3: "a b c a b c a b" -> "c a b c".
    assert drafts([1, 2, 3, 1, 2, 3, 1, 2], 2, 3, 4) == [3, 1, 2, 3]


def test_token_ids_beyond_int16_and_zero() -> None:
    assert drafts([0, 49151, 0, 49151, 0], 2, 2, 3) == [49151, 0, 49151]


def test_matches_the_plain_scan_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(500):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        assert drafts(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k), (
            tokens,
            min_n,
            max_n,
            k,
        )


def test_proposer_caps_drafts_at_max_model_len() -> None:
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    tokens = np.array([1, 2, 3, 1, 2, 3, 1, 2])
    assert NgramProposer(config, max_model_len=100).propose(tokens) == [3, 1, 2, 3]
    # 8 tokens known, max_model_len 11: at most 11 - 8 - 1 = 2 drafts can ever be emitted.
    assert NgramProposer(config, max_model_len=11).propose(tokens) == [3, 1]
    assert NgramProposer(config, max_model_len=9).propose(tokens) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"num_speculative_tokens": 0, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
            "num_speculative_tokens",
        ),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ],
)
def test_config_refuses_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)
