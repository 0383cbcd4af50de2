"""The KV cache write kernel against its twin: out-of-order slots, skipped tokens, strided inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import write_kv_cache
from kernels.reference import write_kv_cache_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (3, 64, 32), (8, 128, 16)])
def test_write_matches_twin(num_kv_heads, head_dim, block_size, dtype, device, generator):
    num_blocks, num_tokens = 12, 9
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=generator).to(dtype)
    # Key and value as slices of one fused projection output, as the model produces them.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim, generator=generator).to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[4] = -1  # a padding token: written nowhere
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    on_device = cache.clone().to(device)
    write_kv_cache(key.to(device), value.to(device), on_device, slots.to(device))
    assert torch.equal(on_device.cpu(), expected)  # a copy: exact in every dtype
    written = (expected != cache).any(-1).flatten(2).any(0).any(0)  # [blocks * block_size]: slots changed
    assert sorted(torch.nonzero(written).flatten().tolist()) == sorted(s for s in slots.tolist() if s >= 0)


def test_refuses_mismatched_shapes(device):
    cache = torch.zeros(2, 2, 4, 16, 64, device=device)
    key = torch.zeros(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="match"):
        write_kv_cache(
            key, torch.zeros(3, 1, 64, device=device), cache, torch.zeros(3, dtype=torch.long, device=device)
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, key, cache, torch.zeros(2, dtype=torch.long, device=device))
