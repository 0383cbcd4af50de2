"""Per-step state the layers read during one forward pass.

The model runner builds the attention metadata and hands the KV caches in
with ``with set_forward_context(metadata, kv_caches):``; attention layers
fetch them with ``get_forward_context()``. A ``ContextVar`` scopes the value
to the block (and to the thread), so no module global is set and reset by
hand and a forgotten reset cannot leak one step's metadata into the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from services.worker.layers.attention_metadata import AttentionMetadata
    from services.worker.layers.triton_attention import TritonAttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | TritonAttentionMetadata
    # One tensor per layer, [2, num_kv_heads, num_blocks, block_size, head_dim] (layers/attention.py);
    # None while profiling, before the cache exists.
    kv_caches: list[torch.Tensor] | None
    # Which kernels the layers run: "torch" ops or the "triton" kernels
    # (services.worker.layers.triton_attention says how it is chosen).
    backend: str = "torch"
    # With several KV cache groups, each group's metadata (its block tables and slots); a layer
    # reads its group's (``PagedAttention.kv_group``). Empty: every layer reads attn_metadata.
    group_metadata: tuple = ()
    # An int8 cache's scales, one fp32 tensor [2, num_kv_heads, num_blocks, block_size] per layer;
    # None for a float cache.
    kv_scales: list[torch.Tensor] | None = None


_current: ContextVar[ForwardContext | None] = ContextVar("weft_forward_context", default=None)


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | TritonAttentionMetadata,
    kv_caches: list[torch.Tensor] | None,
    backend: str = "torch",
    group_metadata: tuple = (),
    *,
    kv_scales: list[torch.Tensor] | None = None,
) -> Iterator[ForwardContext]:
    context = ForwardContext(attn_metadata, kv_caches, backend, group_metadata, kv_scales)
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def current_backend() -> str:
    """The forward's kernel backend; "torch" outside a forward (a layer called on its own)."""
    context = _current.get()
    return "torch" if context is None else context.backend


def get_forward_context() -> ForwardContext:
    context = _current.get()
    if context is None:
        raise RuntimeError("No forward context: run the model inside `with set_forward_context(...)`.")
    return context
