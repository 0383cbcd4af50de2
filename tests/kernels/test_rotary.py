"""The neox rotary kernel against its twin, in place on slices of a fused QKV output."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import rotary_embedding_ref
from kernels.rotary import rotary_embedding
from services.worker.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 64), (9, 3, 64), (16, 2, 128)])
def test_matches_twin_in_place(num_heads, num_kv_heads, head_dim, dtype, device, generator, close):
    rotary = RotaryEmbedding(head_dim, max_positions=300, base=100000.0)
    positions = torch.tensor([0, 7, 299, 3, 3, 150])
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(len(positions), q_size + 2 * kv_size, generator=generator).to(dtype)
    expected = qkv.clone()
    q, k, _ = expected.split([q_size, kv_size, kv_size], dim=-1)
    rotary_embedding_ref(positions, q, k, rotary.cos, rotary.sin, head_dim)
    on_device = qkv.to(device)
    q, k, _ = on_device.split([q_size, kv_size, kv_size], dim=-1)  # strided rows
    rotary_embedding(positions.to(device), q, k, rotary.cos.to(device), rotary.sin.to(device), head_dim)
    close(on_device, expected, dtype, scale=4)
    assert torch.equal(on_device[:, q_size + kv_size :].cpu(), qkv[:, q_size + kv_size :])  # values untouched


def test_twin_agrees_with_the_layer(generator):
    """The twin's rotation is the one the model's torch path applies (fp32)."""
    rotary = RotaryEmbedding(64, max_positions=64, base=10000.0)
    positions = torch.tensor([1, 5, 63])
    q, k = torch.randn(3, 4 * 64, generator=generator), torch.randn(3, 2 * 64, generator=generator)
    layer_q, layer_k = rotary(positions, q, k)
    rotary_embedding_ref(positions, q, k, rotary.cos, rotary.sin, 64)
    torch.testing.assert_close(q, layer_q)
    torch.testing.assert_close(k, layer_k)


def test_refuses_an_odd_head_dim(device):
    table = torch.zeros(8, 6, device=device)
    with pytest.raises(ValueError, match="even"):
        rotary_embedding(
            torch.zeros(1, dtype=torch.long, device=device),
            torch.zeros(1, 10, device=device),
            torch.zeros(1, 5, device=device),
            table,
            table,
            5,
        )
