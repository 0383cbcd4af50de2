"""The sampler's per-step inputs, built column-wise from the requests that sample.

A feature no request uses this step stays ``None``, so the sampler skips it
without looking at rows: an all-greedy batch costs one argmax.

A request's token filters (``allowed_token_ids``, ``logit_bias``,
``bad_words``) become tensors once, when the worker first samples it
(``TokenFilters``, kept in its ``CachedRequestState``), never again each step.
What one request then costs a step, whatever its lists hold: one masked fill
of a vocabulary row (allowed ids), at most 300 indexed adds (logit_bias),
one indexed fill of its one-token bad words, and a look at only those bad
words whose prefix ends with the token it just produced -- at most as many
token comparisons as its bad words hold tokens (the API bounds those by
--max-prompt-tokens) -- plus its min_tokens stop ids (--max-stop-token-ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from protocol import SamplingParams, SamplingType

_MASK64 = (1 << 64) - 1
_NUMPY = {torch.bool: np.bool_, torch.float32: np.float32, torch.long: np.int64}


def seed_for_output(seed: int, output_index: int) -> int:
    """A 64-bit seed that depends only on (request seed, index of the output token).

    SplitMix64 finalizer over the pair, so neighbouring indices give
    unrelated streams and batch composition or preemption never shift them.
    """
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class TokenFilters:
    """One request's token filters as tensors and lookup tables, built once per request."""

    disallowed: torch.Tensor | None  # [V] bool, True for tokens allowed_token_ids leaves out
    bias_ids: torch.Tensor | None  # [B] long (logit_bias)
    bias_values: torch.Tensor | None  # [B] float
    always_banned: torch.Tensor | None  # [W] long: the last (only) token of one-token bad words
    # A bad word of several tokens, by the last token of its prefix: (prefix, its last token).
    bad_word_tails: dict[int, list[tuple[tuple[int, ...], int]]]

    @classmethod
    def build(cls, params: SamplingParams, vocab_size: int, device) -> TokenFilters | None:
        """None when the request filters nothing (ids past ``vocab_size`` are dropped)."""
        if not (params.allowed_token_ids or params.logit_bias or params.bad_words_token_ids):
            return None
        disallowed = None
        if params.allowed_token_ids:
            disallowed = torch.ones(vocab_size, dtype=torch.bool)
            allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long)
            disallowed[allowed[allowed < vocab_size]] = False
            disallowed = disallowed.to(device)
        bias_ids = bias_values = None
        if params.logit_bias:
            pairs = [(t, b) for t, b in params.logit_bias.items() if t < vocab_size]
            bias_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
            bias_values = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device)
        always: set[int] = set()
        tails: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for word in params.bad_words_token_ids or ():
            if word[-1] >= vocab_size:
                continue  # a token the model cannot produce
            if len(word) == 1:
                always.add(word[-1])
            else:
                tails.setdefault(word[-2], []).append((tuple(word[:-1]), word[-1]))
        banned = torch.tensor(sorted(always), dtype=torch.long, device=device) if always else None
        return cls(disallowed, bias_ids, bias_values, banned, tails)

    def bad_word_bans(self, output: Sequence[int]) -> list[int]:
        """The last token of each bad word whose prefix the output just ended with."""
        if not output or not self.bad_word_tails:
            return []
        bans = []
        for prefix, last in self.bad_word_tails.get(output[-1], ()):
            n = len(prefix)
            if n <= len(output) and tuple(output[len(output) - n :]) == prefix:
                bans.append(last)
        return bans


def cached_filters(state, vocab_size: int, device) -> TokenFilters | None:
    """``state``'s (a CachedRequestState) filters, built on its first sampled step."""
    if not state.token_filters_built:
        state.token_filters = TokenFilters.build(state.sampling_params, vocab_size, device)
        state.token_filters_built = True
    return state.token_filters


@dataclass(frozen=True)
class RequestSamplingInput:
    """What the sampler needs of one request at one step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The request's TokenFilters, kept with it between steps (None with ``filters_given``: none).
    filters: TokenFilters | None = None
    filters_given: bool = False


@dataclass(frozen=True)
class Penalties:
    presence: torch.Tensor  # [N]
    frequency: torch.Tensor  # [N]
    repetition: torch.Tensor  # [N]
    prompt_ids: torch.Tensor  # [N, Lp] long, padded with vocab_size
    output_ids: torch.Tensor  # [N, Lo] long, padded with vocab_size


@dataclass(frozen=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor  # [N] bool
    temperature: torch.Tensor  # [N], 1.0 on greedy rows
    top_k: torch.Tensor | None  # [N] long, vocab_size where off
    top_p: torch.Tensor | None  # [N], 1.0 where off
    min_p: torch.Tensor | None  # [N], 0.0 where off
    penalties: Penalties | None
    # (row, token ids) that must not be sampled now (min_tokens, bad_words), ids in the vocabulary.
    banned: list[tuple[int, torch.Tensor | list[int]]] = field(default_factory=list)
    # (row, [V] bool mask of the tokens it may not sample) (allowed_token_ids).
    allowed: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # (row, token ids [B], biases [B]) added to the row's logits (logit_bias).
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Seeded rows, each with a generator already set for this output index.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; -1 = whole vocabulary

    @property
    def max_num_logprobs(self) -> int | None:
        """The most any row asked for; -1 (whole vocabulary) trumps every count."""
        asked = [n for n in self.num_logprobs if n is not None]
        if -1 in asked:
            return -1
        return max(asked, default=None)


def build_sampling_metadata(
    requests: Sequence[RequestSamplingInput],
    *,
    vocab_size: int,
    eos_token_id: int | None,
    device: torch.device | str = "cpu",
    staging=None,
) -> SamplingMetadata:
    """``staging``: the Triton backend's pinned host buffers (``triton_attention.StepStaging``), for
    a builder called once per step."""
    params = [r.params for r in requests]
    greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    filters = [
        r.filters if r.filters_given else TokenFilters.build(r.params, vocab_size, device) for r in requests
    ]

    def column(name: str, values, dtype=torch.float32) -> torch.Tensor:
        if staging is not None:
            return staging.to_device(f"sampling.{name}", np.asarray(values), _NUMPY[dtype])
        return torch.tensor(values, dtype=dtype, device=device)

    top_k = [vocab_size if p.top_k <= 0 or g else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
    return SamplingMetadata(
        num_rows=len(requests),
        all_greedy=all(greedy),
        greedy=column("greedy", greedy, torch.bool),
        temperature=column("temperature", [1.0 if g else p.temperature for p, g in zip(params, greedy)]),
        top_k=column("top_k", top_k, torch.long) if any(k < vocab_size for k in top_k) else None,
        top_p=column("top_p", top_p) if any(p < 1.0 for p in top_p) else None,
        min_p=column("min_p", min_p) if any(p > 0.0 for p in min_p) else None,
        penalties=_penalties(requests, vocab_size, device),
        banned=_banned_tokens(requests, filters, vocab_size, eos_token_id),
        allowed=[(i, f.disallowed) for i, f in enumerate(filters) if f and f.disallowed is not None],
        logit_bias=[
            (i, f.bias_ids, f.bias_values) for i, f in enumerate(filters) if f and f.bias_ids is not None
        ],
        generators={
            i: torch.Generator(device=device).manual_seed(seed_for_output(p.seed, len(r.output_token_ids)))
            for i, (p, r) in enumerate(zip(params, requests))
            if p.sampling_type == SamplingType.RANDOM_SEED
        },
        num_logprobs=[p.logprobs for p in params],
    )


def _penalties(requests, vocab_size: int, device) -> Penalties | None:
    params = [r.params for r in requests]
    if all(
        p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 for p in params
    ):
        return None
    uses_prompt = any(p.repetition_penalty != 1 for p in params)
    return Penalties(
        presence=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
        prompt_ids=_padded([r.prompt_token_ids if uses_prompt else () for r in requests], vocab_size, device),
        output_ids=_padded([r.output_token_ids for r in requests], vocab_size, device),
    )


def _padded(rows: Sequence[Sequence[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            # A list, or a numpy view of the worker's token ids (one copy in C, however long the prompt).
            out[i, : len(row)] = torch.as_tensor(
                row if hasattr(row, "dtype") else list(row), dtype=torch.long
            )
    return out.to(device)


def _banned_tokens(
    requests, filters: list[TokenFilters | None], vocab_size: int, eos_token_id: int | None
) -> list[tuple[int, torch.Tensor | list[int]]]:
    banned: list[tuple[int, torch.Tensor | list[int]]] = []
    for i, (r, f) in enumerate(zip(requests, filters)):
        tokens = _min_tokens_bans(r, vocab_size, eos_token_id)
        if f is not None:
            tokens += f.bad_word_bans(r.output_token_ids)
            if f.always_banned is not None:
                banned.append((i, f.always_banned))
        if tokens:
            banned.append((i, tokens))
    return banned


def _min_tokens_bans(r: RequestSamplingInput, vocab_size: int, eos_token_id: int | None) -> list[int]:
    p = r.params
    if len(r.output_token_ids) >= p.min_tokens:
        return []
    tokens = [t for t in p.stop_token_ids or () if t < vocab_size]
    if eos_token_id is not None and not p.ignore_eos and eos_token_id < vocab_size:
        tokens.append(eos_token_id)
    return tokens
