"""Pooling parameters: what an embeddings request asks of the engine.

A request carrying them is prompt-only: the engine prefills its prompt,
never samples, and finishes it with one pooled hidden state (after the
model's final norm, before the LM head) instead of tokens.
"""

from __future__ import annotations

import enum

import msgspec


class PoolingType(enum.StrEnum):
    """How a prompt's hidden states become one vector."""

    LAST = "last"  # the last prompt token's (decoder embedding models: Qwen3-Embedding, e5-mistral)
    MEAN = "mean"  # the mean over every prompt token's


class PoolingParams(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Field order is the wire contract (``array_like``): append new fields at the end, with defaults."""

    pooling_type: PoolingType = PoolingType.LAST
    # L2-normalize the pooled vector (what OpenAI's embeddings are).
    normalize: bool = True

    @property
    def needs_every_position(self) -> bool:
        """Mean pooling reads every prompt position's hidden state: no position may come from the
        prefix cache, whose blocks hold K/V, not hidden states."""
        return self.pooling_type == PoolingType.MEAN
