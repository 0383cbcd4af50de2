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

On CPU the "cpu" backend packs every weight once, after loading, into
oneDNN's blocked layout (``pack_linear_weights``): ``F.linear`` on CPU
repacks its weight on every call, which at decode batch sizes costs about
as much as the product itself. The packed copy replaces the weight.

Weights kept quantized (GGUF, ``--quantization gguf``) arrive as
``PackedWeight`` sources; a layer collects its slices of them in
``packed_parts`` and runs them through ``quant`` once
``finalize_quantized`` has made it (``services.worker.layers.quantized_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.distributed import TensorParallelGroup, divide
from services.worker.layers.int8_linear import Int8Weight
from services.worker.layers.quantized_linear import PackedWeight, QuantizedWeight


def copy_weight(dest: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(source.shape):
        raise ValueError(
            f"Checkpoint tensor of shape {tuple(source.shape)} does not fit {name} {tuple(dest.shape)}."
        )
    dest.copy_(source)


def keep_packed(layer: nn.Module, part: int, source: PackedWeight) -> None:
    """Hold a packed slice for ``finalize_quantized`` (the dense weight stays unfilled)."""
    if not hasattr(layer, "packed_parts"):
        layer.packed_parts = {}
    layer.packed_parts[part] = source


def whole(source) -> torch.Tensor:
    """All of a checkpoint tensor (``source`` may be a lazy slice)."""
    return source.narrow(0, 0, source.shape[0])


# oneDNN picks its blocking for this many rows; any other count still works
# (measured here: 64 is as fast as 1 or 2048 at those sizes, and best between).
_PACK_ROWS_HINT = 64


class LinearBase(nn.Module):
    """``x W^T (+ b)`` for the weight-holding layers, through the packed copy of W
    once ``pack_weight`` has made one."""

    weight: nn.Parameter | None
    packed_weight: torch.Tensor | None = None
    packed_bytes: int = 0  # what the packed copy stands for, for the memory budget
    quant: QuantizedWeight | None = None  # the weight kept quantized, when it is
    # With ``quant``: from this many rows of x on, the dense copy in ``weight`` (or
    # ``packed_weight``) runs instead; 0: there is no copy.
    dense_min_rows: int = 0
    # An int8 copy beside it (``--dense-copy-dtype int8``), for the steps it takes (``Int8Weight.takes``).
    int8: Int8Weight | None = None

    def runs_packed(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs the weight kept quantized (the packed kernels)."""
        return self.quant is not None and not 0 < self.dense_min_rows <= rows

    def int8_copy_for(self, rows: int) -> Int8Weight | None:
        """The int8 copy when ``linear`` runs a step of ``rows`` rows on it, else None."""
        if self.int8 is None or self.runs_packed(rows) or not self.int8.takes(rows):
            return None
        return self.int8

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.runs_packed(rows):
            return self.quant.linear(x, bias)
        if (int8 := self.int8_copy_for(rows)) is not None:
            return int8.linear(x, bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def pack_weight(self, keep_weight: bool = False) -> None:
        """Pack W for oneDNN (check ``can_pack`` first); unless ``keep_weight`` (W is
        shared, as a tied LM head's is with the embedding), W itself is freed."""
        weight = self.weight
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        if not keep_weight:
            self.packed_bytes = weight.numel() * weight.element_size()
            self.weight = None  # so weights load before packing, never after


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch has oneDNN's packed linear for ``dtype`` on ``device``."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    # Private ops (torch's own CPU compiler path uses them): a torch without them runs unpacked.
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack_linear_weights(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Pack every linear weight of ``model`` (see the module notes); False where it cannot."""
    if not can_pack(dtype, device):
        return False
    for module in model.modules():
        if isinstance(module, LinearBase) and module.packed_weight is None and module.weight is not None:
            # A kept-quantized layer's dense copy is its own, even where a tied head's packed weight is shared.
            shared = getattr(module, "weight_is_shared", False) and module.quant is None
            module.pack_weight(keep_weight=shared)
    return True


def packed_weights_bytes(model: nn.Module) -> int:
    """Bytes of the weights that packing, or an int8 dense copy, holds outside ``model.parameters()``."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    return sum(m.packed_bytes + (m.int8.nbytes if m.int8 is not None else 0) for m in layers)


class Linear(LinearBase):
    """A replicated linear layer: every rank holds all of it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


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


class ColumnParallelLinear(LinearBase):
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
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, sum(output_sizes)]."""
        return self.linear(x, self.bias)

    def load_weight(self, param_name: str, source, shard: int | None) -> None:
        part = shard or 0
        piece = self.slices[part]
        offset = sum(self.output_sizes[:part])
        if isinstance(source, PackedWeight):
            keep_packed(self, part, source.narrow(0, piece.start, piece.size))
            return
        dest = getattr(self, param_name).narrow(0, offset, piece.size)
        copy_weight(dest, source.narrow(0, piece.start, piece.size), f"{param_name} part {part}")


class RowParallelLinear(LinearBase):
    """Keeps this rank's slice of the input columns; all-reduces the partial sums.

    The bias is added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        in_name: str = "in_features",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_slice = even_slices([in_features], tp, [in_name])[0]
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_slice.size, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / world_size] -> [T, out], the same on every rank."""
        if self.tp.world_size == 1:
            return self.linear(x, self.bias)
        y = self.tp.all_reduce(self.linear(x, None))
        return y if self.bias is None else y + self.bias

    def load_weight(self, param_name: str, source, shard: int | None) -> None:
        if param_name == "bias":
            copy_weight(self.bias, whole(source), "bias")
            return
        if isinstance(source, PackedWeight):
            keep_packed(self, 0, source.narrow(1, self.in_slice.start, self.in_slice.size))
            return
        copy_weight(self.weight, source.narrow(1, self.in_slice.start, self.in_slice.size), "weight")
