"""Whole blocks out of and into the paged KV cache, and their wire form."""

from __future__ import annotations

import pytest
import torch

from services.kv_transfer.block_store import is_intact
from services.kv_transfer.kv_blocks import PagedKVBlocks, torch_dtype
from services.worker.layers.attention import kv_cache_shape

LAYERS, KVH, BLOCKS, BS, D = 3, 2, 8, 4, 8


def caches_of(num_blocks: int, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    """A random paged KV cache: one [2, KVH, num_blocks, BS, D] tensor per layer."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(kv_cache_shape(num_blocks, BS, KVH, D), generator=g).to(dtype) for _ in range(LAYERS)]


def caches(dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    return caches_of(BLOCKS, dtype, seed)


def test_gather_takes_every_layer_of_each_block():
    kv = caches()
    blocks = PagedKVBlocks(kv)
    gathered = blocks.gather([5, 2])
    assert gathered.shape == (2, LAYERS, 2, KVH, BS, D) and gathered.is_contiguous()
    for i, block_id in enumerate([5, 2]):
        for layer in range(LAYERS):
            assert torch.equal(gathered[i, layer], kv[layer][:, :, block_id])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_survive_the_wire_into_other_slots(dtype):
    source, target = PagedKVBlocks(caches(dtype, seed=1)), PagedKVBlocks(caches(dtype, seed=2))
    keys = [b"a", b"b", b"c"]
    wire = source.to_wire(keys, source.gather([1, 4, 6]))
    assert [b.key for b in wire] == keys
    assert all(is_intact(b, source.dtype_name, source.block_shape) for b in wire)
    assert wire[0].data.nbytes == source.block_nbytes == LAYERS * 2 * KVH * BS * D * dtype.itemsize
    untouched = target.kv_caches[0][:, :, 0].clone()
    target.scatter([7, 3, 2], target.from_wire(wire))
    for src, dst in zip(source.kv_caches, target.kv_caches):
        assert torch.equal(dst[:, :, [7, 3, 2]], src[:, :, [1, 4, 6]])
    assert torch.equal(target.kv_caches[0][:, :, 0], untouched)  # other blocks keep their KV


def test_dtype_names_are_checked():
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        torch_dtype("int8")
    with pytest.raises(ValueError, match="no KV cache"):
        PagedKVBlocks([])
