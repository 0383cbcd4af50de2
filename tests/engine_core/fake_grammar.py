"""A torch-free stand-in for the grammar backend, for scheduler-level tests.

A "regex" here is a list of token ids written as text ("7 8 9"): its grammar
allows exactly those tokens in order, then the stop token. Compiles can be
held (``release`` cleared) to test waiting and timeouts without sleeping.
"""

from __future__ import annotations

import threading

import numpy as np

from protocol import StructuredOutputsParams
from services.engine_core.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

HOLD_LIMIT_S = 30.0  # a held compile gives up after this, so a failing test cannot hang


def lowest_allowed(row: np.ndarray) -> int:
    """The smallest token id a packed mask row allows."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return int(np.flatnonzero(bits)[0])


class SequenceGrammar(StructuredOutputGrammar):
    def __init__(self, tokens: list[int], stop_token_id: int) -> None:
        self._tokens = [*tokens, stop_token_id]
        self._pos = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if self.is_terminated() or self._tokens[self._pos] != token_id:
                return False
            self._pos += 1
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        expected = self._tokens[self._pos :]
        n = 0
        while n < min(len(token_ids), len(expected)) and token_ids[n] == expected[n]:
            n += 1
        return token_ids[:n]

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= self._pos
        self._pos -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        token_id = self._tokens[self._pos]
        words = bitmask.view(np.uint32)
        words[row] = 0
        words[row, token_id // 32] = np.uint32(1 << (token_id % 32))

    def is_terminated(self) -> bool:
        return self._pos == len(self._tokens)

    def reset(self) -> None:
        self._pos = 0


class FakeBackend(StructuredOutputBackend):
    def __init__(self, vocab_size: int, stop_token_id: int) -> None:
        self.vocab_size = vocab_size
        self.stop_token_id = stop_token_id
        self.compiled: list[str] = []  # the specs compiled, in order
        self.started = threading.Event()  # set when a compile begins
        self.release = threading.Event()  # compiles wait for it
        self.release.set()

    def compile(self, params: StructuredOutputsParams) -> list[int]:
        self.started.set()
        self.release.wait(HOLD_LIMIT_S)
        self.compiled.append(params.spec)
        words = params.regex.split() if params.kind == "regex" else []
        if not words or not all(w.isdigit() for w in words):
            raise ValueError(f"fake backend: {params.spec!r} is not a list of token ids")
        return [int(w) for w in words]

    def new_grammar(self, compiled: list[int]) -> SequenceGrammar:
        return SequenceGrammar(compiled, self.stop_token_id)
