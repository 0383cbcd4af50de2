"""The cpu backend's oneDNN-packed linear weights against F.linear on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.distributed import TensorParallelGroup
from services.worker.layers.linear import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    RowSlice,
    can_pack,
    pack_linear_weights,
    packed_weights_bytes,
)
from services.worker.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

ONE_RANK = TensorParallelGroup(rank=0, world_size=1)
CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not can_pack(torch.float32, CPU), reason="this torch has no oneDNN")


def filled(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_layers_compute_what_they_computed(rows):
    layers = [
        filled(Linear(48, 40, bias=True, dtype=torch.float32), 0),
        filled(
            ColumnParallelLinear(48, [RowSlice(0, 24), RowSlice(0, 8)], bias=False, dtype=torch.float32), 1
        ),
        filled(RowParallelLinear(48, 40, bias=True, dtype=torch.float32, tp=ONE_RANK), 2),
    ]
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(3))
    for layer in layers:
        want = F.linear(x, layer.weight, layer.bias)
        assert pack_linear_weights(layer, torch.float32, CPU)
        assert layer.weight is None and layer.packed_weight is not None
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not can_pack(torch.bfloat16, CPU), reason="oneDNN has no bf16 on this CPU")
def test_bf16_packed_layers_round_like_f_linear():
    layer = filled(ColumnParallelLinear(64, [RowSlice(0, 96)], bias=True, dtype=torch.bfloat16), 6)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert pack_linear_weights(layer, torch.bfloat16, CPU)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=2e-2)  # bf16 output rounding of values ~8


def test_tied_head_keeps_the_embedding_and_the_budget_counts_every_weight():
    embedding = filled(VocabParallelEmbedding(50, 16, torch.float32, ONE_RANK), 4)
    head = ParallelLMHead(50, 16, torch.float32, ONE_RANK, tied_to=embedding)
    mlp = filled(Linear(16, 32, bias=False, dtype=torch.float32), 5)
    model = torch.nn.ModuleList([embedding, head, mlp])
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    hidden = torch.randn(3, 16)
    want_logits, want_mlp = F.linear(hidden, embedding.weight), F.linear(hidden, mlp.weight)
    assert pack_linear_weights(model, torch.float32, CPU)
    assert head.weight is embedding.weight  # the embedding still looks its rows up
    assert embedding(torch.tensor([3, 7])).shape == (2, 16)
    torch.testing.assert_close(head.compute_logits(hidden), want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mlp(hidden), want_mlp, atol=1e-5, rtol=1e-5)
    after = sum(p.numel() * p.element_size() for p in model.parameters()) + packed_weights_bytes(model)
    assert after == before


def test_only_cpu_float_weights_are_packed():
    assert not can_pack(torch.float32, torch.device("cuda"))
    assert not can_pack(torch.float16, CPU)
    layer = Linear(8, 8, bias=False, dtype=torch.float16)
    assert not pack_linear_weights(layer, torch.float16, CPU)
    assert layer.packed_weight is None and layer.weight is not None
