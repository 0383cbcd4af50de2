"""Write the random-word workloads: ``smoke-8``, ``offline-64``, ``shared-prefix-96``, ``short-16``
and ``long-2048``.

Each prompt is a run of words drawn (Python's ``random``, a fixed seed) from
the default tokenizer's single-token words: the vocabulary entries that are a
space and three or more lowercase letters, sorted. A word is exactly one
token, so the text and ``prompt_token_ids`` describe the same prompt. The
lengths are uniform in the ranges each description names, drawn in the
order below; a change to that order changes every file.

    weft bench make-workload offline-64
"""

from __future__ import annotations

import random
import re

from benchmarks.bench.workload import workload_file
from services.api.tokenizer import Tokenizer

# The byte-level BPE marks a leading space with "Ġ".
_WORD = re.compile(r"Ġ[a-z]{3,}")


def single_token_words(tokenizer: Tokenizer) -> list[tuple[str, int]]:
    """(word, token id) for every single-token word, in alphabetical order."""
    vocab = tokenizer.backend.get_vocab()
    return sorted((token[1:], token_id) for token, token_id in vocab.items() if _WORD.fullmatch(token))


def _draw(rng: random.Random, words: list[tuple[str, int]], count: int) -> list[tuple[str, int]]:
    return [rng.choice(words) for _ in range(count)]


def _request(words: list[tuple[str, int]], max_tokens: int) -> dict:
    return {
        "prompt": "".join(" " + word for word, _ in words),
        "prompt_token_ids": [token_id for _, token_id in words],
        "max_tokens": max_tokens,
    }


def _uniform(
    tokenizer: Tokenizer, seed: int, count: int, prompt: tuple[int, int], output: tuple[int, int]
) -> list[dict]:
    """``count`` requests; for each, its prompt length, output length, then its words.

    ``prompt`` and ``output`` are (low, high), both ends included (``randint``).
    """
    rng, words = random.Random(seed), single_token_words(tokenizer)
    requests = []
    for _ in range(count):
        length, max_tokens = rng.randint(*prompt), rng.randint(*output)
        requests.append(_request(_draw(rng, words, length), max_tokens))
    return requests


def _shared_prefix(tokenizer: Tokenizer) -> list[dict]:
    """8 prefixes first; then each request picks one and draws its own suffix."""
    rng, words = random.Random(77), single_token_words(tokenizer)
    prefixes = [_draw(rng, words, rng.randint(256, 640)) for _ in range(8)]
    requests = []
    for _ in range(96):
        prefix = rng.choice(prefixes)
        requests.append(_request(prefix + _draw(rng, words, rng.randint(16, 64)), 48))
    return requests


def build_smoke(tokenizer: Tokenizer) -> dict:
    requests = _uniform(tokenizer, 5, 8, (8, 64), (4, 16))
    return workload_file("smoke-8", "8 requests, prompt 8..64, output 4..16, seed 5, for tests", requests)


def build_offline(tokenizer: Tokenizer) -> dict:
    requests = _uniform(tokenizer, 1234, 64, (32, 512), (32, 256))
    description = "64 requests, prompt 32..512 tokens, output 32..256 tokens, uniform, seed 1234"
    return workload_file("offline-64", description, requests)


def build_shared_prefix(tokenizer: Tokenizer) -> dict:
    description = (
        "96 requests over 8 shared prefixes of 256..640 tokens, each + a 16..64-token suffix, "
        "48 output tokens, seed 77"
    )
    return workload_file("shared-prefix-96", description, _shared_prefix(tokenizer))


def build_short(tokenizer: Tokenizer) -> dict:
    """smoke-8's prompts, then the same with " again" in front, 64 new tokens each: the real-size
    single-stream and 16-stream runs (short prompts, so decode dominates)."""
    smoke = build_smoke(tokenizer)["requests"]
    again = dict(single_token_words(tokenizer))["again"]
    requests = [{**r, "max_tokens": 64} for r in smoke]
    requests += [
        {
            "prompt": " again" + r["prompt"],
            "prompt_token_ids": [again, *r["prompt_token_ids"]],
            "max_tokens": 64,
        }
        for r in smoke
    ]
    description = "smoke-8's 8 prompts, then the same with ' again' in front; 64 output tokens each"
    return workload_file("short-16", description, requests)


def build_long(tokenizer: Tokenizer) -> dict:
    """Three distinct prompts of exactly 2,048 tokens, 4 new tokens each: time to first token of a
    long fresh prompt."""
    rng, words = random.Random(2048), single_token_words(tokenizer)
    requests = [_request(_draw(rng, words, 2048), 4) for _ in range(3)]
    return workload_file(
        "long-2048", "3 requests of 2,048 prompt tokens, 4 output tokens, seed 2048", requests
    )
