"""What the structured-output manager needs from a grammar library.

A backend compiles a request's constraint against the model's vocabulary
once (slow; cached and shared by requests with the same constraint) and
makes a cheap per-request ``StructuredOutputGrammar`` from the result: the
matcher that follows the request's tokens and says, before each sampling
step, which tokens may come next.

Masks are packed int32 rows: bit ``j`` of word ``w`` allows token
``32 * w + j``; a row of all ones (``-1``) allows everything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from protocol import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one mask row: 32 tokens per word."""
    return -(-vocab_size // 32)


class StructuredOutputGrammar(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False at the first token the grammar refuses
        (the tokens before it stay accepted)."""

    @abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of ``token_ids`` the grammar would accept; the state
        does not change."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the mask of the tokens allowed next into ``bitmask[row]``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar ended (it accepted a stop token): nothing more may follow."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start, as if no token had been accepted."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one model vocabulary. ``compile`` runs on
    worker threads and must be thread-safe."""

    vocab_size: int  # the model's vocabulary (logits width), which masks cover

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile ``params``' constraint; ValueError naming the problem if it is invalid."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher over a compiled constraint (cheap)."""
