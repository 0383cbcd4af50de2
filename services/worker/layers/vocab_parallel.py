"""The token embedding and the LM head, split over tensor-parallel ranks by vocabulary rows.

Rank ``r`` holds rows ``[r * P, (r + 1) * P)`` with ``P = ceil(vocab /
world_size)``; rows past the vocabulary (on the last ranks) are zero padding.

- Embedding: each rank looks up the ids it holds, writes zeros for the
  others, and an all-reduce adds the one non-zero row per token (exact:
  ``x + 0 == x``).
- LM head: each rank computes its ``[N, P]`` slice of the logits; they are
  gathered on the driver only, the rank that samples. With tied embeddings
  the head reads the embedding's own parameter, so the split is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.distributed import TensorParallelGroup
from services.worker.layers.linear import LinearBase, copy_weight, keep_packed
from services.worker.layers.quantized_linear import PackedWeight, QuantizedWeight


@dataclass(frozen=True)
class VocabShard:
    """Rows ``[start, start + num_rows)`` of the vocabulary, padded to ``rows_per_rank``."""

    vocab_size: int
    rows_per_rank: int
    start: int
    num_rows: int

    @classmethod
    def of_rank(cls, vocab_size: int, tp: TensorParallelGroup) -> VocabShard:
        rows_per_rank = math.ceil(vocab_size / tp.world_size)
        start = min(tp.rank * rows_per_rank, vocab_size)
        return cls(vocab_size, rows_per_rank, start, min(rows_per_rank, vocab_size - start))

    def new_weight(self, dim: int, dtype: torch.dtype) -> nn.Parameter:
        weight = torch.empty(self.rows_per_rank, dim, dtype=dtype)
        weight[self.num_rows :].zero_()  # padding: never looked up, its logits cut off
        return nn.Parameter(weight, requires_grad=False)

    def load(self, weight: torch.Tensor, source, name: str) -> PackedWeight | None:
        """Copy this rank's rows of ``source`` into ``weight``; a packed source's rows are returned instead."""
        if source.shape[0] != self.vocab_size:
            raise ValueError(
                f"Checkpoint tensor {name} has {source.shape[0]} rows, the vocabulary {self.vocab_size}."
            )
        if isinstance(source, PackedWeight):  # padding rows: zero weights, as above
            return source.narrow(0, self.start, self.num_rows).pad_rows(self.rows_per_rank)
        copy_weight(weight[: self.num_rows], source.narrow(0, self.start, self.num_rows), name)


class VocabParallelEmbedding(nn.Module):
    quant: QuantizedWeight | None = None  # kept quantized (see linear.py)

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.shard = VocabShard.of_rank(vocab_size, tp)
        self.weight = self.shard.new_weight(dim, dtype)
        self.dtype = dtype  # of the lookups, once a packed weight replaces self.weight

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> [T, dim]."""
        if self.tp.world_size == 1:
            return self._lookup(token_ids)
        local = token_ids - self.shard.start
        elsewhere = (local < 0) | (local >= self.shard.num_rows)  # [T]
        x = self._lookup(local.masked_fill(elsewhere, 0))  # [T, dim]
        return self.tp.all_reduce(x.masked_fill_(elsewhere[:, None], 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.embed(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def load_weight(self, param_name: str, source, shard: int | None) -> None:
        packed = self.shard.load(self.weight, source, "embed_tokens.weight")
        if packed is not None:
            keep_packed(self, 0, packed)


class ParallelLMHead(LinearBase):
    """hidden -> logits over the whole vocabulary, on the driver rank."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        tied_to: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.shard = VocabShard.of_rank(vocab_size, tp)
        # Tied: the embedding's own Parameter (named_parameters lists it once);
        # packing then keeps it, for the embedding.
        self.weight_is_shared = tied_to is not None
        self.weight = tied_to.weight if tied_to is not None else self.shard.new_weight(dim, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, dim] -> fp32 logits [N, vocab] on the driver; None on the other ranks.

        Every rank must call it (the gather is a collective).
        """
        local = self.linear(hidden, None)  # [N, rows_per_rank]
        logits = self.tp.gather(local, dim=-1)  # [N, world_size * rows_per_rank] on the driver
        if logits is None:
            return None
        return logits[:, : self.shard.vocab_size].float()

    def load_weight(self, param_name: str, source, shard: int | None) -> None:
        packed = self.shard.load(self.weight, source, "lm_head.weight")
        if packed is not None:
            keep_packed(self, 0, packed)
