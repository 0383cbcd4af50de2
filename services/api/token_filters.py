"""The request fields that steer the sampler token by token, checked and made engine-ready.

``logit_bias`` (OpenAI's, string token ids as JSON keys), vLLM's
``allowed_token_ids`` and ``bad_words``: every token id is checked against
the vocabulary here (a 400 naming the field), and each bad word is
tokenized, since the worker has no tokenizer.
"""

from __future__ import annotations

from typing import Any

from services.api.errors import bad_request
from services.api.tokenizer import Tokenizer

# The sampler checks every bad word of a request at every step: keep that bounded.
MAX_BAD_WORDS = 1024


def token_filters(tokenizer: Tokenizer, vocab_size: int, body: Any) -> dict[str, Any]:
    """The SamplingParams fields of the body's token filters."""
    return {
        "logit_bias": logit_bias_of(vocab_size, body.logit_bias),
        "allowed_token_ids": _unique(
            check_token_ids(vocab_size, body.allowed_token_ids, "allowed_token_ids")
        ),
        "bad_words": body.bad_words,
        "bad_words_token_ids": bad_words_token_ids(tokenizer, body.bad_words),
    }


def logit_bias_of(vocab_size: int, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string-keyed logit_bias as token id -> bias; 400 on a key that is no token id.
    (SamplingParams bounds the biases.)"""
    if bias is None:
        return None
    try:
        ids = {int(key): value for key, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings).", "logit_bias") from None
    check_token_ids(vocab_size, list(ids), "logit_bias")
    return ids


def check_token_ids(vocab_size: int, ids: list[int] | None, param: str) -> list[int] | None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise bad_request(f"{param} holds token id {bad}, outside the vocabulary (size {vocab_size}).", param)
    return ids


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str] | None) -> list[list[int]] | None:
    """Each bad word's tokens, alone and after a space: as vLLM, a word is banned both
    at the start of the text and mid-text, where BPE tokenizers spell it differently."""
    if words is None:
        return None
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(
            f"bad_words holds {len(words)} words; at most {MAX_BAD_WORDS} are allowed.", "bad_words"
        )
    sequences: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words must not hold blank words.", "bad_words")
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences += [alone] if spaced == alone else [alone, spaced]
    return sequences


def _unique(ids: list[int] | None) -> list[int] | None:
    """Token ids without repeats (the sampler looks at each once per step)."""
    return None if ids is None else sorted(set(ids))
