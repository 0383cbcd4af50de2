"""The sampler's per-step inputs, built column-wise from the requests that sample.

A feature no request uses this step stays ``None``, so the sampler skips it
without looking at rows: an all-greedy batch costs one argmax.
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
class RequestSamplingInput:
    """What the sampler needs of one request at one step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


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
    # (row, token ids) that must not be sampled now (min_tokens, bad_words).
    banned: list[tuple[int, list[int]]] = field(default_factory=list)
    # (row, token ids): the only tokens the row may sample (allowed_token_ids).
    allowed: list[tuple[int, list[int]]] = field(default_factory=list)
    # (row, token ids, biases) added to the row's logits (logit_bias).
    logit_bias: list[tuple[int, list[int], list[float]]] = field(default_factory=list)
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
        banned=_banned_tokens(requests, eos_token_id),
        allowed=[(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids],
        logit_bias=[
            (i, list(p.logit_bias), list(p.logit_bias.values())) for i, p in enumerate(params) if p.logit_bias
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
        out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    return out.to(device)


def _banned_tokens(requests, eos_token_id: int | None) -> list[tuple[int, list[int]]]:
    banned = []
    for i, r in enumerate(requests):
        tokens = _min_tokens_bans(r, eos_token_id) + _bad_word_bans(r)
        if tokens:
            banned.append((i, tokens))
    return banned


def _min_tokens_bans(r: RequestSamplingInput, eos_token_id: int | None) -> list[int]:
    p = r.params
    if len(r.output_token_ids) >= p.min_tokens:
        return []
    tokens = list(p.stop_token_ids or [])
    if eos_token_id is not None and not p.ignore_eos:
        tokens.append(eos_token_id)
    return tokens


def _bad_word_bans(r: RequestSamplingInput) -> list[int]:
    """The last token of each bad word whose other tokens the output just ended
    with: sampling it would complete the word (a one-token word is always banned)."""
    words = r.params.bad_words_token_ids
    if not words:
        return []
    output = r.output_token_ids
    bans = []
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or list(output[len(output) - len(prefix) :]) == prefix):
            bans.append(word[-1])
    return bans
