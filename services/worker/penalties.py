"""Logit adjustments applied before sampling (greedy included)."""

from __future__ import annotations

import torch

from services.worker.sampling_metadata import Penalties


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token_ids [N, L] padded with vocab_size -> counts [N, vocab_size]."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """logits [N, V] -> penalized [N, V] (new tensor).

    Repetition (divides positive logits, multiplies negative ones) looks at
    prompt and output tokens; presence and frequency at output tokens only,
    as in vLLM and the OpenAI API.
    """
    vocab = logits.shape[1]
    output_counts = token_counts(penalties.output_ids, vocab)  # [N, V]
    seen = (output_counts + token_counts(penalties.prompt_ids, vocab)) > 0
    rep = penalties.repetition[:, None]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, repeated, logits)
    logits = logits - penalties.frequency[:, None] * output_counts
    return logits - penalties.presence[:, None] * (output_counts > 0).to(logits.dtype)


def ban_tokens(logits: torch.Tensor, banned: list[tuple[int, torch.Tensor | list[int]]]) -> None:
    """Set the logits of tokens a row may not produce now (min_tokens, bad_words) to -inf, in
    place (the ids are in the vocabulary: ``build_sampling_metadata`` left the others out)."""
    for row, tokens in banned:
        logits[row, tokens] = float("-inf")


def restrict_tokens(logits: torch.Tensor, allowed: list[tuple[int, torch.Tensor]]) -> None:
    """Leave each listed row only its allowed tokens (allowed_token_ids), in place: each row
    comes with its [V] mask of the tokens it may not sample, built once per request."""
    for row, disallowed in allowed:
        logits[row].masked_fill_(disallowed, float("-inf"))


def add_logit_bias(logits: torch.Tensor, biases: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
    """Add OpenAI's logit_bias (token ids [B], biases [B], built once per request) to each listed row, in place."""
    for row, ids, values in biases:
        logits[row].index_add_(0, ids, values.to(logits.dtype))
