"""The request fields that steer the sampler token by token, checked and made engine-ready.

``logit_bias`` (OpenAI's, string token ids as JSON keys), vLLM's
``allowed_token_ids`` and ``bad_words``: every token id is checked against
the vocabulary here (a 400 naming the field), and each bad word is
tokenized, since the worker has no tokenizer. Each is bounded: at most
``MAX_LOGIT_BIAS_ENTRIES`` biases (OpenAI's 300), no more allowed ids than
the vocabulary holds, and bad words within the request's text and token
limits (``--max-prompt-chars``, ``--max-prompt-tokens``).
"""

from __future__ import annotations

from typing import Any

from services.api.errors import bad_request
from services.api.limits import ServingLimits
from services.api.openai_schemas import SamplingFields
from services.api.tokenizer import Tokenizer

# The sampler checks every bad word of a request at every step: keep that bounded.
MAX_BAD_WORDS = 1024
# OpenAI's bound on a request's logit_bias.
MAX_LOGIT_BIAS_ENTRIES = 300


def token_filters(
    tokenizer: Tokenizer,
    vocab_size: int,
    body: SamplingFields,
    limits: ServingLimits | None = None,
    max_bad_word_tokens: int | None = None,
) -> dict[str, Any]:
    """The SamplingParams fields of the body's token filters (``max_bad_word_tokens``: the
    most tokens the bad words may come to, all together)."""
    allowed = body.allowed_token_ids
    if allowed is not None and len(allowed) > vocab_size:
        raise bad_request(
            f"allowed_token_ids holds {len(allowed)} ids, more than the vocabulary's {vocab_size}.",
            "allowed_token_ids",
        )
    return {
        "logit_bias": logit_bias_of(vocab_size, body.logit_bias),
        "allowed_token_ids": _unique(check_token_ids(vocab_size, allowed, "allowed_token_ids")),
        "bad_words": body.bad_words,
        "bad_words_token_ids": bad_words_token_ids(tokenizer, body.bad_words, limits, max_bad_word_tokens),
    }


def logit_bias_of(vocab_size: int, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string-keyed logit_bias as token id -> bias; 400 on a key that is no token id.
    (SamplingParams bounds the biases.)"""
    if bias is None:
        return None
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(
            f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed.",
            "logit_bias",
        )
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


def bad_words_token_ids(
    tokenizer: Tokenizer,
    words: list[str] | None,
    limits: ServingLimits | None = None,
    max_tokens: int | None = None,
) -> list[list[int]] | None:
    """Each bad word's tokens, alone and after a space: as vLLM, a word is banned both
    at the start of the text and mid-text, where BPE tokenizers spell it differently.
    Their text counts against ``max_prompt_chars`` (checked before tokenizing), their
    tokens against ``max_tokens`` (the prompt's own limit)."""
    if words is None:
        return None
    limits = limits or ServingLimits()
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(
            f"bad_words holds {len(words)} words; at most {MAX_BAD_WORDS} are allowed.", "bad_words"
        )
    limits.check_text_size(words, "bad_words")
    if any(not word.strip() for word in words):
        raise bad_request("bad_words must not hold blank words.", "bad_words")
    stripped = [word.lstrip() for word in words]
    # One call per spelling: the tokenizer's batch encoding runs in Rust, off the GIL.
    alone = tokenizer.encode_batch(stripped, add_special_tokens=False)
    spaced = tokenizer.encode_batch([" " + word for word in stripped], add_special_tokens=False)
    sequences: list[list[int]] = []
    for a, s in zip(alone, spaced):
        sequences += [a] if s == a else [a, s]
    total = sum(map(len, sequences))
    if max_tokens is not None and total > max_tokens:
        raise bad_request(
            f"bad_words come to {total} tokens; this server takes at most {max_tokens} "
            "(as many as a prompt may hold, --max-prompt-tokens).",
            "bad_words",
        )
    return sequences


def _unique(ids: list[int] | None) -> list[int] | None:
    """Token ids without repeats (the sampler looks at each once per step)."""
    return None if ids is None else sorted(set(ids))
