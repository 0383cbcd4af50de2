"""Logprobs of chosen tokens and of the top alternatives, as wire structs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol import TokenLogprobs


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """One entry per row: the given token, then the row's ``num_top[i]`` most likely.

    logprobs [N, V] (log_softmax of the raw logits), token_ids [N] long;
    a count of -1 means the whole vocabulary. Rank 1 is the most likely token.
    """
    if logprobs.shape[0] == 0:
        return []
    vocab = logprobs.shape[1]
    counts = [vocab if n == -1 else min(n, vocab) for n in num_top]
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()  # [N]
    top_values, top_ids = logprobs.topk(max(counts), dim=1)  # [N, k_max] each
    ids = torch.cat([token_ids[:, None], top_ids], dim=1).tolist()
    values = torch.cat([chosen, top_values], dim=1).tolist()
    return [
        TokenLogprobs(token_ids=ids[i][: 1 + k], logprobs=values[i][: 1 + k], rank=ranks[i])
        for i, k in enumerate(counts)
    ]
