"""Paged attention, torch backend (CPU, and the reference on GPU).

KV cache layout, one tensor per layer::

    [2, num_kv_heads, num_blocks, block_size, head_dim]   (0: keys, 1: values)

Token slot ``s = block_id * block_size + offset`` is row ``s`` of the
``[2, num_kv_heads, num_blocks * block_size, head_dim]`` view. Heads come
before blocks so that gathering a sequence's blocks yields, per head, one
contiguous ``[tokens, head_dim]`` run: SDPA reads the gathered keys as they
are, with no transpose copy, which is most of a decode step's attention
time on CPU.

Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA),
the same grouping Hugging Face's ``repeat_kv`` makes.

On CPU, decodes and all but the largest prefills go to compiled kernels
(``kernels/cpu_attention.py``, the "cpu" backend) when they could be built:
they read K/V in place through the block table, with no gather
(``attention_metadata.py`` says which prefills). On CUDA the forward context selects the
Triton backend instead (``triton_attention.py``), with the same cache
layout.

An int8 cache (``--kv-cache-dtype int8``) has the same layout in int8, and
beside it one fp32 scale per token and KV head, ``[2, num_kv_heads,
num_blocks, block_size]`` (the forward context's ``kv_scales``): the compiled
kernels write and read it; the torch backend writes it with the twin's torch
ops and dequantizes what it gathers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_attention import paged_decode_attention, paged_prefill_attention, write_kv_int8
from kernels.cpu_attention import write_kv as write_kv_cpu
from kernels.reference import dequantize_kv_rows, write_kv_int8_ref
from services.worker.forward_context import get_forward_context
from services.worker.layers.attention_metadata import DecodeGroup, PrefillSeq
from services.worker.layers.sliding_window import window_metadata


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


def write_kv(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's keys and values ([T, KVH, D] each) in their slots."""
    two, kvh, nb, bs, d = cache.shape
    rows = cache.view(two, kvh, nb * bs, d)
    rows[0].index_copy_(1, slot_mapping, key.transpose(0, 1))
    rows[1].index_copy_(1, slot_mapping, value.transpose(0, 1))


class GatherWorkspace:
    """One reusable buffer for the decode K/V gathers of every layer.

    A gather of tens of MiB allocated afresh would be served by mmap and
    page-faulted in on every layer of every step (glibc maps blocks above
    32 MiB directly), which costs as much as the attention itself. Layers
    run one after another, so they share the buffer.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``shape`` with ``like``'s dtype and device; its contents are garbage."""
        numel = math.prod(shape)
        buffer = self._buffer
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            buffer = self._buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(shape)


def decode_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    workspace: GatherWorkspace | None = None,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence over its cached keys: query [n, H, D] -> [n, H, D]."""
    n, num_heads, d = query.shape
    _, kvh, num_blocks, bs, _ = cache.shape
    blocks = cache.view(2 * kvh, num_blocks, bs * d)
    if workspace is None or scales is not None:
        kv = blocks.index_select(1, group.block_ids)  # [2 * KVH, n * nb, bs * D]
    else:
        kv = workspace.take((2 * kvh, group.block_ids.numel(), bs * d), cache)
        torch.index_select(blocks, 1, group.block_ids, out=kv)
    if scales is not None:
        row_scales = scales.view(2 * kvh, num_blocks, bs).index_select(1, group.block_ids)
        kv = dequantize_kv_rows(kv.view(*row_scales.shape, d), row_scales, query.dtype)
    kv = kv.view(2, kvh, n, group.num_blocks * bs, d)  # [2, KVH, n, L, D]
    # Fold the query heads that share a KV head into SDPA's "query length".
    q = query.view(n, kvh, num_heads // kvh, d).transpose(0, 1)  # [KVH, n, G, D]
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=group.mask, scale=scale)
    return out.transpose(0, 1).reshape(n, num_heads, d)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor | None,
    seq: PrefillSeq,
    scale: float,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens [n, H, D] attend causally to the context + themselves -> [n, H, D].

    Inputs are 4-D ([1, heads, tokens, D]): torch's fused CPU kernel takes
    only those; 3-D ones fall back to the unfused path, several times slower.
    """
    q = query.transpose(0, 1)[None]  # [1, H, n, D]
    if seq.block_ids is None:
        k, v = key.transpose(0, 1)[None], value.transpose(0, 1)[None]  # [1, KVH, n, D]
        causal = seq.mask is None  # a window layer's long prompt brings its own mask
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seq.mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)
    assert cache is not None, "context attention needs the KV cache"
    _, kvh, _, bs, d = cache.shape
    seq_len = seq.context_len + query.shape[0]
    kv = cache[:, :, seq.block_ids]  # [2, KVH, nb, bs, D]
    if scales is not None:
        kv = dequantize_kv_rows(kv, scales[:, :, seq.block_ids], query.dtype)
    kv = kv.reshape(2, 1, kvh, -1, d)[..., :seq_len, :]  # [2, 1, KVH, S, D]
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=seq.mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


class PagedAttention(nn.Module):
    """Attention of one layer over the paged KV cache (no weights)."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        workspace: GatherWorkspace | None = None,
        *,
        sliding_window: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})."
            )
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window  # None: full attention
        self.kv_group = 0  # which KV cache group's block tables this layer reads (set by the model runner)
        # The CPU kernel reads memory through the step's indices: the first layer reading a
        # group's tables checks them in full (the model runner marks one layer per group).
        self.checks_decode_args = layer_idx == 0
        self.workspace = workspace or GatherWorkspace()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [T, H * D], key and value [T, KVH * D] (rotated) -> [T, H * D]."""
        context = get_forward_context()
        meta = context.group_metadata[self.kv_group] if context.group_metadata else context.attn_metadata
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_dim)
        k = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        cache = None if context.kv_caches is None else context.kv_caches[self.layer_idx]
        scales = None if context.kv_scales is None else context.kv_scales[self.layer_idx]
        if context.backend == "triton":  # a window is the kernel's argument
            from services.worker.layers.triton_attention import triton_attention

            out = triton_attention(q, k, v, cache, meta, self.scale, self.sliding_window or 0)
            return out.view(num_tokens, self.num_heads * self.head_dim)
        if self.sliding_window is not None:
            meta = window_metadata(meta, self.sliding_window)
        if scales is not None and context.backend == "cpu":
            write_kv_int8(k, v, cache, scales, meta.slot_mapping, check=self.checks_decode_args)
        elif scales is not None:  # the torch backend (no compiled kernels): the twin's torch ops
            write_kv_int8_ref(k, v, cache, scales, meta.slot_mapping)
        elif cache is not None and context.backend == "cpu":  # index_copy_'s result in one call
            write_kv_cpu(k, v, cache, meta.slot_mapping, check=self.checks_decode_args)
        elif cache is not None:
            write_kv(cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.paged_decodes is not None or meta.paged_prefills is not None:
            assert cache is not None, "the CPU kernels read the KV cache"
            self._run_cpu_kernels(q, cache, scales, meta, out)
        for group in meta.decode_groups:
            assert cache is not None, "decodes need the KV cache"
            out[group.token_idx] = decode_attention(
                q[group.token_idx], cache, group, self.scale, self.workspace, scales
            )
        for seq in meta.prefills:
            s = slice(seq.start, seq.end)
            out[s] = prefill_attention(q[s], k[s], v[s], cache, seq, self.scale, scales)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _run_cpu_kernels(
        self, q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, meta, out: torch.Tensor
    ) -> None:
        """The step's decodes and short prefills, K/V read in place (the new ones written already).

        The kernels check the index values they read memory through on every call; the shapes
        and dtypes are checked by the first layer of each KV cache group only, since its later
        layers get the same metadata and caches of the same shape. A window layer passes its
        window: the kernels read no block before it."""
        window = self.sliding_window or 0
        if (d := meta.paged_decodes) is not None:
            paged_decode_attention(
                q, cache, d.token_idx, d.seq_lens, d.block_table, self.scale, out,
                check=self.checks_decode_args, window=window, kv_scales=scales,
            )  # fmt: skip
        if (p := meta.paged_prefills) is not None:
            paged_prefill_attention(
                q, cache, p.query_start, p.query_lens, p.context_lens, p.block_table, self.scale, out,
                check=self.checks_decode_args, window=window, kv_scales=scales,
            )  # fmt: skip
