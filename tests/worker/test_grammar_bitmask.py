"""The worker's side of structured outputs: unpacking masks and masking logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol import CachedRequestData, SchedulerOutput
from services.worker.structured_output import (
    apply_grammar_bitmask,
    bitmask_bias,
    logits_rows,
    with_grammar_bitmask,
)

NEG_INF = float("-inf")


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [R, V] -> packed int32 [R, ceil(V / 32)], the scheduler's layout."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), dtype=bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def output(
    ids: list[str], bitmask: np.ndarray | None, spec: dict[str, list[int]] | None = None
) -> SchedulerOutput:
    return SchedulerOutput(
        [],
        CachedRequestData(),
        {},
        0,
        scheduled_spec_decode_tokens=spec or {},
        structured_output_request_ids=ids,
        grammar_bitmask=bitmask,
    )


def allowed_by(bias: torch.Tensor) -> torch.Tensor:
    assert set(bias.unique().tolist()) <= {0.0, NEG_INF}
    return bias == 0


def test_unpacking_matches_a_per_bit_reference():
    rng = np.random.default_rng(0)
    packed = rng.integers(-(2**31), 2**31, size=(4, 5), dtype=np.int64).astype(np.int32)
    allowed = allowed_by(bitmask_bias(torch.from_numpy(packed), 160))
    reference = [[bool((int(packed[r, t // 32]) >> (t % 32)) & 1) for t in range(160)] for r in range(4)]
    assert allowed.tolist() == reference


def test_unpacking_cuts_or_forbids_past_the_mask():
    packed = torch.full((2, 2), -1, dtype=torch.int32)  # 64 tokens, all allowed
    assert bitmask_bias(packed, 40).shape == (2, 40) and allowed_by(bitmask_bias(packed, 40)).all()
    wider = allowed_by(bitmask_bias(packed, 70))
    assert wider[:, :64].all() and not wider[:, 64:].any()  # padded vocab rows stay forbidden


def test_only_the_constrained_rows_are_masked():
    vocab = 100
    logits = torch.randn(3, vocab)
    before = logits.clone()
    allowed = np.zeros((1, vocab), dtype=bool)
    allowed[0, [3, 50, 99]] = True
    apply_grammar_bitmask(logits, output(["b"], pack(allowed)), {"a": 0, "b": 1, "c": 2})
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.equal(logits[1, [3, 50, 99]], before[1, [3, 50, 99]])
    forbidden = np.setdiff1d(np.arange(vocab), [3, 50, 99])
    assert torch.isinf(logits[1, forbidden]).all() and (logits[1, forbidden] < 0).all()


def test_the_model_vocabulary_past_the_mask_is_forbidden():
    logits = torch.zeros(1, 40)
    apply_grammar_bitmask(logits, output(["a"], np.full((1, 1), -1, dtype=np.int32)), {"a": 0})
    assert (logits[0, :32] == 0).all() and (logits[0, 32:] == NEG_INF).all()


def test_spec_decode_requests_get_one_mask_row_per_position():
    first_row = logits_rows(["a", "b", "c"], np.array([True, False, True]), {"a": [5, 6]})
    assert first_row == {"a": 0, "c": 3}  # a has 2 drafts + 1 bonus row; b does not sample
    vocab = 64
    allowed = np.zeros((4, vocab), dtype=bool)
    for row, token in enumerate([1, 2, 3, 4]):
        allowed[row, token] = True
    logits = torch.zeros(4, vocab)
    apply_grammar_bitmask(logits, output(["a", "c"], pack(allowed), {"a": [5, 6]}), first_row)
    assert [int(row.argmax()) for row in logits] == [1, 2, 3, 4]
    assert torch.isfinite(logits).sum() == 4


def test_mismatched_masks_are_refused():
    logits = torch.zeros(2, 32)
    with pytest.raises(ValueError, match="does not sample"):
        apply_grammar_bitmask(logits, output(["x"], np.full((1, 1), -1, np.int32)), {"a": 0})
    with pytest.raises(ValueError, match="2 rows for 1 sampled positions"):
        apply_grammar_bitmask(logits, output(["a"], np.full((2, 1), -1, np.int32)), {"a": 0})


def test_a_read_only_received_mask_is_fine():
    mask = np.full((1, 1), 1, dtype=np.int32)  # only token 0
    mask.flags.writeable = False
    logits = torch.zeros(1, 32)
    apply_grammar_bitmask(logits, output(["a"], mask), {"a": 0})
    assert logits[0, 0] == 0 and (logits[0, 1:] == NEG_INF).all()


def test_the_wrapper_masks_what_compute_logits_returns():
    hidden = torch.zeros(2, 4)
    compute = lambda h: torch.zeros(h.shape[0], 32)  # noqa: E731
    assert with_grammar_bitmask(compute, output([], None), ["a"], np.array([True])) is compute
    masked = with_grammar_bitmask(
        compute, output(["b"], np.full((1, 1), 2, np.int32)), ["a", "b"], np.array([True, True])
    )
    logits = masked(hidden)
    assert (logits[0] == 0).all() and logits[1, 1] == 0 and torch.isinf(logits[1]).sum() == 31
    # Tensor-parallel followers get no logits: nothing to mask.
    assert (
        with_grammar_bitmask(
            lambda h: None, output(["a"], np.full((1, 1), 2, np.int32)), ["a"], np.array([True])
        )(hidden)
        is None
    )
