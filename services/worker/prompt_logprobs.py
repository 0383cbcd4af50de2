"""Logprobs of the prompt's own tokens, for requests that ask for them.

The hidden state at position ``p`` predicts token ``p + 1``, so a chunk
covering prompt positions ``[start, end)`` yields the entries of tokens
``start + 1 .. end`` (within the prompt); the first chunk also carries the
``None`` of token 0, which nothing predicts. Summed over chunks, a request
receives one entry per prompt token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from protocol import TokenLogprobs
from services.worker.input_batch import CachedRequestState
from services.worker.logprobs import token_logprobs

# Positions per logits slice: bounds the [n, vocab] temporaries of a long chunk.
_SLICE = 256


def chunk_prompt_logprobs(
    state: CachedRequestState,
    hidden: torch.Tensor,
    context_len: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
) -> list[TokenLogprobs | None]:
    """hidden [n, H]: this step's hidden states of the request, from position ``context_len``."""
    num_prompt = state.num_prompt_tokens
    end = min(context_len + hidden.shape[0], num_prompt - 1)
    entries: list[TokenLogprobs | None] = [None] if context_len == 0 else []
    count = state.sampling_params.prompt_logprobs
    targets = torch.tensor(state.prompt_token_ids, device=hidden.device)
    for start in range(context_len, end, _SLICE):
        stop = min(start + _SLICE, end)
        logits = compute_logits(hidden[start - context_len : stop - context_len])
        if logits is None:  # a tensor-parallel follower only joins the driver's gather
            continue
        logprobs = logits.log_softmax(dim=-1)
        entries += token_logprobs(logprobs, targets[start + 1 : stop + 1], [count] * (stop - start))
    return entries
