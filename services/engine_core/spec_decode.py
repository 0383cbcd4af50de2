"""Speculative decoding, scheduler side: drafts in, accepted runs out.

The worker proposes drafts after it samples (``ModelRunnerOutput.spec_token_ids``);
they wait on ``request.spec_token_ids`` until the request's next step, where
they are scheduled as extra tokens: they count against the token budget and
get KV slots. The worker verifies them in that step's forward and returns the
accepted run (1 to drafts + 1 tokens). The drafts it rejected had their KV
written at positions the request does not own, so ``num_computed_tokens``
steps back over them; the next step overwrites those slots.
"""

from __future__ import annotations

from typing import TypedDict

from protocol import ModelRunnerOutput, SpeculativeConfig
from services.engine_core.request import Request


class SpecDecodeStats(TypedDict):
    """``SchedulerStats``' speculative-decoding fields."""

    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: list[int]


class SpecDecodeScheduling:
    """Draft accounting for one scheduler; inert when ``config`` is None."""

    def __init__(self, config: SpeculativeConfig | None, max_model_len: int) -> None:
        self.num_spec_tokens = 0 if config is None else config.num_speculative_tokens
        self.max_model_len = max_model_len
        self._reset_stats()

    def num_schedulable_drafts(self, request: Request) -> int:
        """How many of the request's drafts may run this step.

        Only a request that is decoding (all but its newest token computed)
        verifies drafts. A step emits at most drafts + 1 tokens, so the
        drafts are capped to what max_tokens and max_model_len leave.
        """
        if not request.spec_token_ids or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        room = self.max_model_len - request.num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, min(len(request.spec_token_ids), room))

    @staticmethod
    def scheduled_drafts(request: Request, num_new_tokens: int) -> list[int]:
        """The drafts covered by ``num_new_tokens`` (the budget may cut some off)."""
        num_drafts = request.num_computed_tokens + num_new_tokens - request.num_tokens
        return request.spec_token_ids[:num_drafts] if num_drafts > 0 else []

    def apply_output(
        self, request: Request, drafts: list[int], index: int | None, runner_output: ModelRunnerOutput
    ) -> None:
        """Roll back the rejected drafts, and keep the drafts proposed for the next step.

        Must run before the sampled tokens are appended (the stop checks may
        end the request part-way through its accepted run).
        """
        if drafts:
            sampled = runner_output.sampled_token_ids[index] if index is not None else []
            assert sampled, "a request verifying drafts always samples"
            num_accepted = len(sampled) - 1
            assert 0 <= num_accepted <= len(drafts), (request.request_id, drafts, sampled)
            request.num_computed_tokens -= len(drafts) - num_accepted
            self._record(len(drafts), num_accepted)
        proposals = runner_output.spec_token_ids
        request.spec_token_ids = (
            list(proposals[index]) if index is not None and index < len(proposals) else []
        )

    # ----------------------------------------------------------------- stats

    def _record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def _reset_stats(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_spec_tokens

    def take_stats(self) -> SpecDecodeStats:
        """The counters since the previous call, as ``SchedulerStats`` fields."""
        stats: SpecDecodeStats = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": self.accepted_per_pos if self.num_drafts else [],
        }
        self._reset_stats()
        return stats
