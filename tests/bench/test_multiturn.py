"""The multi-turn workload: every turn extends its conversation's previous prompt."""

from __future__ import annotations

import pytest

from benchmarks.bench.multiturn import multiturn_workload


def test_each_turn_extends_the_previous_turns_prompt_and_answer():
    w = multiturn_workload(
        num_conversations=3, num_turns=4, system_len=40, user_len=8, answer_len=6, output_len=5, seed=1
    )
    assert len(w.requests) == 12 and w.num_output_tokens == 60
    for c in range(3):
        turns = [w.requests[k * 3 + c].prompt_token_ids for k in range(4)]
        for k in range(1, 4):
            assert turns[k][: len(turns[k - 1])] == turns[k - 1], "the history is resent whole"
            assert len(turns[k]) == len(turns[k - 1]) + 6 + 8
    # Conversations do not share a prefix with each other.
    firsts = [w.requests[c].prompt_token_ids[:16] for c in range(3)]
    assert len({tuple(f) for f in firsts}) == 3
    assert multiturn_workload(seed=1, num_conversations=2, num_turns=2) == multiturn_workload(
        seed=1, num_conversations=2, num_turns=2
    )


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_turns"):
        multiturn_workload(num_turns=0)
