"""Apply the scheduler's grammar masks to the logits, before sampling.

The scheduler sends one packed int32 mask row per sampled position of each
constrained request (``SchedulerOutput.grammar_bitmask``): bit ``j`` of word
``w`` allows token ``32 * w + j``. Here the rows are unpacked on the logits'
device and every forbidden token gets ``-inf``, in the logits rows of those
requests only. Vocabulary ids past the mask (a model vocabulary padded
beyond the tokenizer's) are forbidden too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from protocol import SchedulerOutput

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
# 0xFF800000 as an int32: the bits of float32 -inf.
_NEG_INF_BITS = -(1 << 23)


def logits_rows(req_ids: list[str], samples: np.ndarray, spec_tokens: dict[str, list[int]]) -> dict[str, int]:
    """First logits row of each sampling request: the sampled requests in
    scheduled order, each with one row per draft token plus one."""
    first_row, row = {}, 0
    for req_id, sampling in zip(req_ids, samples):
        if sampling:
            first_row[req_id] = row
            row += 1 + len(spec_tokens.get(req_id, ()))
    return first_row


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] packed masks -> float32 [R, vocab_size]: 0 where a token
    is allowed, -inf where it is forbidden, to add to the logits."""
    # Byte by byte: on a little-endian machine (every one torch runs on), bit
    # j of a word is bit j % 8 of its byte j // 8, so unpacking bytes keeps
    # token order and the temporary is a quarter the size of unpacking words.
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    bits = (as_bytes.unsqueeze(-1) >> _BIT_SHIFTS.to(bitmask.device)) & 1  # [R, 4W, 8]
    # Branch-free (masked_fill branches per element, several times slower on
    # CPU): allowed 1 -> 0 -> the bits of 0.0; forbidden 0 -> -1 -> those of -inf.
    bias = bits.to(torch.int32).sub_(1).bitwise_and_(_NEG_INF_BITS).view(torch.float32)
    bias = bias.reshape(bitmask.shape[0], -1)  # [R, 32 * W]
    if bias.shape[1] >= vocab_size:
        return bias[:, :vocab_size]
    padding = bias.new_full((bias.shape[0], vocab_size - bias.shape[1]), float("-inf"))
    return torch.cat([bias, padding], dim=1)


def apply_grammar_bitmask(
    logits: torch.Tensor, scheduler_output: SchedulerOutput, first_row: dict[str, int]
) -> None:
    """Set -inf, in place, on the tokens the grammars forbid. logits [N, V]."""
    bitmask = scheduler_output.grammar_bitmask
    if bitmask is None or not scheduler_output.structured_output_request_ids:
        return
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    rows = []
    for req_id in scheduler_output.structured_output_request_ids:
        if req_id not in first_row:
            raise ValueError(
                f"The scheduler sent a grammar mask for request {req_id}, which does not sample this step."
            )
        start = first_row[req_id]
        rows.extend(range(start, start + 1 + len(spec_tokens.get(req_id, ()))))
    if len(rows) != bitmask.shape[0]:
        raise ValueError(f"The grammar mask has {bitmask.shape[0]} rows for {len(rows)} sampled positions.")
    # A copy: the mask may be a read-only view of a received frame.
    packed = torch.tensor(np.asarray(bitmask), device=logits.device)  # [R, W]
    bias = bitmask_bias(packed, logits.shape[1]).to(logits.dtype)  # [R, V]
    if rows == list(range(logits.shape[0])):
        logits.add_(bias)  # every row is constrained
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)


def with_grammar_bitmask(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    scheduler_output: SchedulerOutput,
    req_ids: list[str],
    samples: np.ndarray,
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """``compute_logits`` for this step's sampled positions, masked by the grammars.

    The model runner's sampling paths (plain and speculative) both compute
    logits for the sampled positions in the order ``logits_rows`` describes,
    so wrapping the one call covers both.
    """
    if scheduler_output.grammar_bitmask is None:
        return compute_logits
    first_row = logits_rows(req_ids, samples, scheduler_output.scheduled_spec_decode_tokens)

    def masked(hidden: torch.Tensor) -> torch.Tensor | None:
        logits = compute_logits(hidden)  # [N, V]; None on tensor-parallel followers
        if logits is not None:
            apply_grammar_bitmask(logits, scheduler_output, first_row)
        return logits

    return masked
