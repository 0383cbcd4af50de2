"""Sampling parameters, as vLLM users know them.

Validated on construction and on decode (msgspec runs ``__post_init__`` in
both cases), so a bad value is refused at the edge with a ``ValueError``
that names the field and what is allowed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import msgspec

from protocol.structured_outputs import StructuredOutputsParams

# Below this temperature a request is greedy (vLLM uses the same cut-off).
_GREEDY_TEMPERATURE = 1e-5
_MAX_N = 16384
# OpenAI's bound on one logit_bias entry.
MAX_LOGIT_BIAS = 100.0


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(msgspec.Struct, omit_defaults=True, dict=True):
    """How to pick the next tokens of one request.

    Field order is part of the wire contract only through msgpack maps here
    (not ``array_like``), so fields may be added anywhere, with defaults.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: False leaves out the spaces some tokenizers' decoders (WordPiece) put
    # between two added tokens in a row, when special tokens are shown.
    spaces_between_special_tokens: bool = True
    # Guided decoding: the output must match this constraint.
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits of these token ids (OpenAI's logit_bias), in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words that must not appear; the front end tokenizes them into
    # ``bad_words_token_ids`` (the worker has no tokenizer).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return ValueError(f"{field} must be {allowed}, got {getattr(self, field)!r}.")

        if not 1 <= self.n <= _MAX_N:
            raise bad("n", f"an integer in [1, {_MAX_N}]")
        for field in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, field) <= 2.0:
                raise bad(field, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "greater than 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "-1, 0 (both disable it) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < -1:
            raise bad("logprobs", "a non-negative integer, or -1 for the whole vocabulary")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise bad("prompt_logprobs", "a non-negative integer, or -1 for the whole vocabulary")
        if self.stop is not None and any(not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        self._validate_token_filters(bad)

    def _validate_token_filters(self, bad: Callable[[str, str], ValueError]) -> None:
        # min() walks the long lists in C: a request's filters are checked again wherever it is decoded.
        if self.logit_bias:
            if min(self.logit_bias) < 0:
                raise bad("logit_bias", "keyed by non-negative token ids")
            if not all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()):
                raise bad("logit_bias", f"a map of biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            raise bad("allowed_token_ids", "a non-empty list of non-negative token ids")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise bad("bad_words", "a list of words that are not blank")
        if self.bad_words_token_ids is not None and any(
            not ids or min(ids) < 0 for ids in self.bad_words_token_ids
        ):
            raise bad("bad_words_token_ids", "non-empty lists of non-negative token ids")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def stop_strings(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]
