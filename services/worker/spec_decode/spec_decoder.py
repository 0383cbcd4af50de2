"""The model runner's speculative-decoding steps: drafts in, verified tokens out.

A step that verifies drafts runs them as ordinary inputs after each request's
known tokens (``write_drafts``), so the forward scores every draft position
at once. ``sample`` then takes the logits of each sampling request's last
``drafts + 1`` positions to the rejection sampler and records the emitted
tokens in the batch. After every step, ``propose`` finds the drafts each
request will verify next.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from protocol import EngineConfig, TokenLogprobs
from services.worker.distributed import get_tp_group
from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.sampling_metadata import RequestSamplingInput, build_sampling_metadata, cached_filters
from services.worker.spec_decode.ngram import NgramProposer
from services.worker.spec_decode.rejection_sampler import RejectionSampler
from services.worker.step_inputs import StepInputs, record_emitted, sampling_states


class SpecDecoder:
    def __init__(
        self,
        config: EngineConfig,
        generator: torch.Generator,
        device: torch.device,
        compiled_argmax: bool = False,
    ) -> None:
        assert config.speculative is not None, "built only when speculation is on"
        self.proposer = NgramProposer(config.speculative, config.model.max_model_len)
        self.rejection_sampler = RejectionSampler(generator, compiled_argmax)
        self.eos_token_id = config.model.eos_token_id
        self.device = device
        k = config.speculative.num_speculative_tokens
        max_num_seqs = config.scheduler.max_num_seqs
        # Verifying drafts samples up to max_num_seqs * (k + 1) positions: that
        # many logits rows, but the sampler's [rows, vocab] temporaries are
        # made for at most max_num_seqs rows at a time (whole requests), as
        # without speculation, so they do not eat the KV cache's memory.
        self.max_logits_rows = max_num_seqs * (k + 1)
        self.max_chunk_rows = max(max_num_seqs, k + 1)

    @staticmethod
    def write_drafts(batch: InputBatch, spec_tokens: dict[str, list[int]]) -> dict[str, int]:
        """Place each request's drafts right after its known tokens (without making
        them known), and return how many each has."""
        for req_id, drafts in spec_tokens.items():
            row = batch.requests[req_id].row
            start = int(batch.num_tokens[row])
            if start + len(drafts) > batch.max_model_len:
                raise ValueError(
                    f"Request {req_id}: {len(drafts)} drafts after {start} tokens pass max_model_len."
                )
            batch.token_ids[row, start : start + len(drafts)] = drafts
        return {req_id: len(drafts) for req_id, drafts in spec_tokens.items()}

    def sample(
        self,
        hidden: torch.Tensor,
        step: StepInputs,
        spec_tokens: dict[str, list[int]],
        batch: InputBatch,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[list[list[int]], list[list[TokenLogprobs]]]:
        """hidden [T, H] of the step -> per scheduled request, its emitted tokens and their logprobs."""
        rows, states = sampling_states(step, batch)
        if rows.size == 0:
            return record_emitted(step, batch, rows, [], [])
        drafts = [spec_tokens.get(state.req_id, []) for state in states]
        ends = step.query_start[1:][rows]
        index = np.concatenate([np.arange(end - len(d) - 1, end) for end, d in zip(ends, drafts)])
        logits = compute_logits(hidden[torch.from_numpy(index).to(hidden.device)])  # [sum(k + 1), V]
        if logits is None:  # a tensor-parallel follower: it takes the driver's tokens
            token_ids, entries_of = self._share_tokens(None, drafts), [[] for _ in drafts]
        else:
            token_ids, entries_of = self._verify(logits, states, drafts)
            token_ids = self._share_tokens(token_ids, drafts)
        return record_emitted(step, batch, rows, token_ids, entries_of)

    def _verify(
        self, logits: torch.Tensor, states: list[CachedRequestState], drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[TokenLogprobs]]]:
        """Rejection-sample the requests' rows (logits [N, V]) a chunk of whole requests at a time."""
        token_ids: list[list[int]] = []
        entries: list[list[TokenLogprobs]] = []
        row = 0
        for first, end in request_chunks(drafts, self.max_chunk_rows):
            num_rows = sum(len(d) + 1 for d in drafts[first:end])
            meta = build_sampling_metadata(
                per_position_inputs(states[first:end], drafts[first:end], logits.shape[1], self.device),
                vocab_size=logits.shape[1],
                eos_token_id=self.eos_token_id,
                device=self.device,
            )
            out = self.rejection_sampler(logits[row : row + num_rows], meta, drafts[first:end])
            token_ids += out.token_ids
            entries += out.logprobs
            row += num_rows
        return token_ids, entries

    def _share_tokens(self, token_ids: list[list[int]] | None, drafts: list[list[int]]) -> list[list[int]]:
        """The driver's emitted tokens on every tensor-parallel rank (None: a follower's
        placeholder), sent as one [R, max drafts + 1] tensor padded with -1."""
        tp = get_tp_group()
        if tp.world_size == 1:
            return token_ids
        packed = torch.full((len(drafts), 1 + max(map(len, drafts))), -1, dtype=torch.long)
        for i, tokens in enumerate(token_ids or ()):
            packed[i, : len(tokens)] = torch.tensor(tokens)
        packed = tp.broadcast_from_driver(packed.to(self.device)).tolist()
        return [[t for t in row if t >= 0] for row in packed]

    def propose(self, batch: InputBatch, req_ids: list[str], sampled: list[list[int]]) -> list[list[int]]:
        """Drafts for the next step of each request that sampled this step."""
        drafts = []
        for req_id, tokens in zip(req_ids, sampled):
            if not tokens:
                drafts.append([])  # mid-prefill: it has no next decode step yet
                continue
            row = batch.requests[req_id].row
            drafts.append(self.proposer.propose(batch.token_ids[row, : batch.num_tokens[row]]))
        return drafts


def request_chunks(drafts: list[list[int]], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive ranges ``[first, end)`` of whole requests, each holding at most
    ``max_rows`` rows (``len(drafts) + 1`` per request) unless one request alone is more."""
    chunks, first, rows = [], 0, 0
    for i, d in enumerate(drafts):
        if i > first and rows + len(d) + 1 > max_rows:
            chunks.append((first, i))
            first, rows = i, 0
        rows += len(d) + 1
    if drafts:
        chunks.append((first, len(drafts)))
    return chunks


def per_position_inputs(
    states: list[CachedRequestState],
    drafts: list[list[int]],
    vocab_size: int | None = None,
    device: torch.device | str = "cpu",
) -> list[RequestSamplingInput]:
    """One sampling row per verified position: row ``j`` of a request sees the drafts
    before it as outputs, so penalties, min_tokens and per-output seeds apply as
    they would had those tokens been emitted one step at a time. With ``vocab_size``,
    every row of a request shares its token filters, kept with it between steps."""
    inputs = []
    for state, d in zip(states, drafts):
        given = vocab_size is not None
        filters = cached_filters(state, vocab_size, device) if given else None
        for j in range(len(d) + 1):
            output = state.output_token_ids + d[:j] if j else state.output_token_ids
            inputs.append(
                RequestSamplingInput(
                    state.sampling_params, state.prompt_token_ids, output, filters, filters_given=given
                )
            )
    return inputs
