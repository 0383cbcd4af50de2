"""Pooling: an embeddings request's prompt hidden states -> one L2-normalized vector.

The hidden states are the model's output (after its final norm, before the
LM head). A pooling request's vector is ready in the step that runs its last
prompt token. Last-token pooling reads that token's row. Mean pooling needs
every prompt position, and a prompt may be prefilled in chunks over several
steps: the worker keeps each request's running sum (``CachedRequestState.
pooled_sum``, fp32) and divides at the end. Chunking stays allowed, so a mean
prompt longer than one step's token budget is still served; the scheduler
keeps such requests off the prefix cache (cached positions have no hidden
states), and a preempted one comes back as new, its sum started again.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from protocol import PoolingType
from services.worker.input_batch import InputBatch
from services.worker.step_inputs import StepInputs


def pool_step(
    hidden: torch.Tensor, step: StepInputs, batch: InputBatch
) -> tuple[list[str], np.ndarray | None]:
    """The pooling requests whose prompt ends in this step, and their vectors (float32 [N, H]).
    ``hidden``: [T, H], the step's tokens back to back (``step.query_start``)."""
    done_ids: list[str] = []
    vectors: list[torch.Tensor] = []
    for i, req_id in enumerate(step.req_ids):
        state = batch.requests[req_id]
        params = state.pooling_params
        if params is None:
            continue
        chunk = hidden[step.query_start[i] : step.query_start[i + 1]]  # [Q, H]
        if params.pooling_type == PoolingType.MEAN:
            chunk_sum = chunk.float().sum(dim=0)  # [H]
            state.pooled_sum = chunk_sum if state.pooled_sum is None else state.pooled_sum + chunk_sum
        if not step.samples[i]:
            continue  # mid-prefill
        if params.pooling_type == PoolingType.MEAN:
            vector = state.pooled_sum / state.num_prompt_tokens
        else:
            vector = chunk[-1].float()
        done_ids.append(req_id)
        vectors.append(F.normalize(vector, dim=0) if params.normalize else vector)
    if not vectors:
        return [], None
    return done_ids, torch.stack(vectors).cpu().numpy()  # [N, H]
