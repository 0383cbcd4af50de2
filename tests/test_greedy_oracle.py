"""``tests.utils.GreedyOracle``, the parity check of the model tests, on a model whose greedy
continuation is known: it passes exactly that continuation and fails every other one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.utils import GreedyOracle

VOCAB, EOS = 10, 9


class NextTokenModel:
    """Greedy next token = (last token + 1) mod 10, through 9 (EOS)."""

    def __call__(self, ids: torch.Tensor, logits_to_keep: int):
        logits = torch.zeros(ids.shape[0], ids.shape[1], VOCAB)
        nxt = (ids + 1) % VOCAB
        logits.scatter_(2, nxt.unsqueeze(-1), 1.0)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])


@pytest.fixture
def oracle():
    return GreedyOracle(NextTokenModel(), EOS)


def test_the_greedy_continuation_passes(oracle):
    oracle.check([1, 2], [3, 4, 5], max_tokens=3, what="up to the limit")
    oracle.check([6], [7, 8, 9], max_tokens=8, what="stopped at EOS")


@pytest.mark.parametrize(
    ("tokens", "max_tokens", "message"),
    [
        ([3, 5, 6], 3, "diverged"),  # the second token is not the argmax
        ([4], 1, "diverged"),  # nor the first
        ([3, 4], 3, "stopped early"),  # short of the limit without EOS
        ([7, 8, 9, 0], 8, "diverged"),  # went on past EOS
    ],
)
def test_any_other_continuation_fails(oracle, tokens, max_tokens, message):
    prompt = [2] if tokens[0] != 7 else [6]
    with pytest.raises(AssertionError, match=message):
        oracle.check(prompt, tokens, max_tokens=max_tokens, what="it")
