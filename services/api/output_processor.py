"""Turns a request's stream of EngineCoreOutputs into text and results.

Torch-free and shared by the API process and the offline ``LLM``: it owns
the incremental detokenizer, the stop strings, the accumulated tokens and
logprobs of one (child) request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protocol import EngineCoreOutput, FinishReason, SamplingParams, TokenLogprobs
from protocol.kv_transfer import KVTransferParams
from services.api.detokenizer import IncrementalDetokenizer
from services.api.tokenizer import Tokenizer


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestState:
    """Everything the front end knows about one engine request."""

    request_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    tokenizer: Tokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_is_internal: bool = False  # the engine failed, not the request's input
    kv_transfer_params: KVTransferParams | None = None  # from the finished output (P/D)
    eos_token_id: int | None = None
    # Echo with max_tokens 0 (vLLM's): only the prompt (and its logprobs) is wanted; the
    # one token the engine still makes is dropped, and the request ends by "length".
    prompt_only: bool = False
    pooled: np.ndarray | None = None  # a pooling request's vector, from its finished output

    @classmethod
    def create(
        cls,
        request_id: str,
        params: SamplingParams,
        tokenizer: Tokenizer,
        eos_token_id: int | None = None,
        prompt_only: bool = False,
    ) -> RequestState:
        state = cls(
            request_id,
            params,
            IncrementalDetokenizer(tokenizer, params),
            tokenizer,
            eos_token_id=eos_token_id,
            prompt_only=prompt_only,
        )
        if params.logprobs is not None:
            state.logprobs = []
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = []
        return state

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def process(self, output: EngineCoreOutput) -> bool:
        """Take one engine output; True when a stop string ended the request here
        (the caller must then abort it in the engine)."""
        self.num_cached_tokens = output.num_cached_tokens or self.num_cached_tokens
        if output.new_prompt_logprobs is not None:
            self.add_prompt_logprobs(output.new_prompt_logprobs)
        if self.prompt_only:
            self._end_prompt_only(output)
            return False
        unshown = self._stop_token_unshown(output)
        for i, token_id in enumerate(output.new_token_ids):
            self.token_ids.append(token_id)
            if output.new_logprobs and i < len(output.new_logprobs):
                self._add_logprobs(output.new_logprobs[i])
            if unshown and i == len(output.new_token_ids) - 1:
                break
            if self.detokenizer.add_tokens([token_id]):
                self.finish_reason = str(FinishReason.STOP)
                self.stop_reason = self.detokenizer.stop_string
                return True
        if output.finish_reason is not None:
            self.finish_reason = str(output.finish_reason)
            self.stop_reason = output.stop_reason
            self.error = output.error
            self.error_is_internal = output.error_is_internal
            self.kv_transfer_params = output.kv_transfer_params
            self.pooled = output.pooled
        return False

    def add_prompt_logprobs(self, entries: list[TokenLogprobs | None]) -> None:
        """Take the prompt logprob entries of an output (the API does it off its event loop)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._convert(e) if e else None for e in entries)

    def _end_prompt_only(self, output: EngineCoreOutput) -> None:
        if output.finish_reason is None:
            return
        ran_out = output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        self.finish_reason = str(FinishReason.LENGTH if ran_out else output.finish_reason)
        self.error = output.error
        self.error_is_internal = output.error_is_internal
        self.kv_transfer_params = output.kv_transfer_params

    def _stop_token_unshown(self, output: EngineCoreOutput) -> bool:
        """True when the output's last token is the stop token or EOS that ended the
        request: vLLM keeps its id in ``token_ids`` but leaves its text out of
        ``text``, unless ``include_stop_str_in_output``."""
        if output.finish_reason != FinishReason.STOP or not output.new_token_ids:
            return False
        if self.params.include_stop_str_in_output:
            return False
        last = output.new_token_ids[-1]
        return last == output.stop_reason or (last == self.eos_token_id and not self.params.ignore_eos)

    def _add_logprobs(self, entry: TokenLogprobs) -> None:
        self.cumulative_logprob += entry.logprobs[0]
        if self.logprobs is not None:
            self.logprobs.append(self._convert(entry))

    def _convert(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        # The chosen token comes first with its true rank; the top-k follow
        # in rank order (the chosen one may appear among them again).
        result = {entry.token_ids[0]: Logprob(entry.logprobs[0], entry.rank, self._piece(entry.token_ids[0]))}
        for rank, (token_id, logprob) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), 1):
            result.setdefault(token_id, Logprob(logprob, rank, self._piece(token_id)))
        return result

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
