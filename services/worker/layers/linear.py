"""Weight-holding linear layers, whole or split over tensor-parallel ranks.

Every weight is overwritten by the loader, so the parameters are allocated
with ``torch.empty`` in the target dtype: no init pass over a large model.

Tensor parallelism (Megatron's split): a column-parallel layer keeps a slice
of the output rows and returns that slice of the output, with no
communication; the row-parallel layer after it keeps the matching slice of
the input columns, computes a partial sum and all-reduces it. So attention
(QKV -> O) and the MLP (gate/up -> down) each cost one all-reduce.

Sharded layers load a checkpoint tensor with ``load_weight(param_name,
source, shard)``: they cut their own slice out of ``source`` (anything with
``shape`` and ``narrow``, so a lazy safetensors slice reads only that part)
before copying it in; no rank keeps a whole checkpoint tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.distributed import TensorParallelGroup, divide


def copy_weight(dest: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(source.shape):
        raise ValueError(f"Checkpoint tensor of shape {tuple(source.shape)} does not fit {name} {tuple(dest.shape)}.")
    dest.copy_(source)


def whole(source) -> torch.Tensor:
    """All of a checkpoint tensor (``source`` may be a lazy slice)."""
    return source.narrow(0, 0, source.shape[0])


class Linear(nn.Module):
    """A replicated linear layer: every rank holds all of it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


@dataclass(frozen=True)
class RowSlice:
    """Rows ``[start, start + size)`` of one checkpoint tensor."""

    start: int
    size: int


def even_slices(sizes: list[int], tp: TensorParallelGroup, names: list[str]) -> list[RowSlice]:
    """This rank's share of each part, every part split evenly over the ranks."""
    shares = [divide(size, tp.world_size, name) for size, name in zip(sizes, names)]
    return [RowSlice(tp.rank * share, share) for share in shares]


def kv_heads_of_rank(num_kv_heads: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """(how many KV heads this rank holds, the first one's index).

    With fewer KV heads than ranks, each KV head is replicated on the
    ``world_size / num_kv_heads`` consecutive ranks whose query heads use it.
    """
    if num_kv_heads >= tp.world_size:
        per_rank = divide(num_kv_heads, tp.world_size, "num_key_value_heads")
        return per_rank, tp.rank * per_rank
    replicas = divide(tp.world_size, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
    return 1, tp.rank // replicas


def qkv_slices(num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallelGroup) -> list[RowSlice]:
    """This rank's rows of the q, k and v projections: its query heads and the KV heads they read."""
    q_heads = divide(num_heads, tp.world_size, "num_attention_heads")
    kv_heads, first_kv = kv_heads_of_rank(num_kv_heads, tp)
    kv = RowSlice(first_kv * head_dim, kv_heads * head_dim)
    return [RowSlice(tp.rank * q_heads * head_dim, q_heads * head_dim), kv, kv]


class ColumnParallelLinear(nn.Module):
    """Keeps some output rows of one or more checkpoint tensors (fused, in order).

    ``slices[i]`` are the rows kept of part ``i`` (q/k/v, or gate/up); the
    output is this rank's parts side by side, e.g. ``[q_r | k_r | v_r]``.
    """

    def __init__(self, in_features: int, slices: list[RowSlice], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.slices = slices
        self.output_sizes = [s.size for s in slices]
        out_features = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, sum(output_sizes)]."""
        return F.linear(x, self.weight, self.bias)

    def load_weight(self, param_name: str, source, shard: int | None) -> None:
        part = shard or 0
        piece = self.slices[part]
        offset = sum(self.output_sizes[:part])
        dest = getattr(self, param_name).narrow(0, offset, piece.size)
        copy_weight(dest, source.narrow(0, piece.start, piece.size), f"{param_name} part {part}")


class RowParallelLinear(nn.Module):
    """Keeps this rank's slice of the input columns; all-reduces the partial sums.

    The bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: TensorParallelGroup, in_name: str = "in_features") -> None:
        super().__init__()
        self.tp = tp
        self.in_slice = even_slices([in_features], tp, [in_name])[0]
        self.weight = nn.Parameter(torch.empty(out_features, self.in_slice.size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / world_size] -> [T, out], the same on every rank."""
        if self.tp.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def load_weight(self, param_name: str, source, shard: int | None) -> None:
        if param_name == "bias":
            copy_weight(self.bias, whole(source), "bias")
            return
        copy_weight(self.weight, source.narrow(1, self.in_slice.start, self.in_slice.size), "weight")
