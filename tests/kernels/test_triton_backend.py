"""The Triton backend inside the model's layers, against the torch backend on the same step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.config.engine_args import resolve_attention_backend
from services.worker.forward_context import current_backend, set_forward_context
from services.worker.layers import backends
from services.worker.layers.activation import silu_and_mul
from services.worker.layers.attention import PagedAttention, kv_cache_shape, write_kv
from services.worker.layers.attention_metadata import build_attention_metadata
from services.worker.layers.backends import check_backend
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.layers.triton_attention import build_triton_metadata

H, KVH, D, BS = 6, 2, 64, 16


def step_inputs(gen):
    """A mixed step: a fresh prefill, a decode, a chunk after a context, over blocks out of order."""
    query_lens, context_lens = np.array([9, 1, 5]), np.array([0, 37, 20])
    seq_lens = query_lens + context_lens
    pool = (torch.randperm(30, generator=gen) + 1).tolist()
    tables = [[pool.pop() for _ in range(-(-n // BS))] for n in seq_lens]
    block_table = np.zeros((3, 4), dtype=np.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = t
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    rows = np.repeat(np.arange(3), query_lens)
    slot_mapping = block_table[rows, positions // BS].astype(np.int64) * BS + positions % BS
    return dict(
        query_lens=query_lens,
        context_lens=context_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        block_size=BS,
    ), tables


def test_attention_layer_backends_agree(generator, close, device):
    inputs, tables = step_inputs(generator)
    cache = torch.zeros(kv_cache_shape(31, BS, KVH, D))
    for blocks, context in zip(tables, inputs["context_lens"]):  # the cached contexts
        if context:
            slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(context)])
            write_kv(
                cache,
                torch.randn(context, KVH, D, generator=generator),
                torch.randn(context, KVH, D, generator=generator),
                slots,
            )
    num_tokens = int(inputs["query_lens"].sum())
    qkv = torch.randn(num_tokens, (H + 2 * KVH) * D, generator=generator).to(device)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    layer = PagedAttention(0, H, KVH, D)
    outputs, caches = [], []
    for backend, build in (("torch", build_attention_metadata), ("triton", build_triton_metadata)):
        caches.append(cache.clone().to(device))
        with set_forward_context(build(**inputs, device=device), [caches[-1]], backend):
            outputs.append(layer(q, k, v))
    close(outputs[1], outputs[0], torch.float32)
    assert torch.equal(caches[1], caches[0])


def test_norm_rotary_and_gate_follow_the_backend(generator, close, device):
    meta = build_triton_metadata(
        query_lens=np.array([4]),
        context_lens=np.array([0]),
        device=device,
        block_table=np.zeros((1, 1), np.int32),
        slot_mapping=np.arange(4),
        block_size=BS,
    )
    norm, rotary = RMSNorm(96, 1e-5), RotaryEmbedding(D, 64, 10000.0)
    norm.weight.data.normal_(1.0, 0.3, generator=generator)
    norm, rotary = norm.to(device), rotary.to(device)
    x, residual = (
        torch.randn(4, 96, generator=generator).to(device),
        torch.randn(4, 96, generator=generator).to(device),
    )
    positions = torch.tensor([0, 1, 2, 40], device=device)
    qk = torch.randn(4, (H + KVH) * D, generator=generator).to(device)
    results = {}
    for backend in ("torch", "triton"):
        with set_forward_context(meta, None, backend):
            assert current_backend() == backend
            q, k = qk.clone().split([H * D, KVH * D], dim=-1)
            # With a residual, RMSNorm works in place (vLLM's fused_add_rms_norm): give it copies.
            added = norm(x.clone(), residual.clone())
            results[backend] = (norm(x), *added, *rotary(positions, q, k), silu_and_mul(qk))
    for got, want in zip(results["triton"], results["torch"]):
        close(got, want, torch.float32, scale=4)
    assert current_backend() == "torch"  # outside any forward


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("WEFT_ATTENTION_BACKEND", raising=False)
    assert resolve_attention_backend("cuda") == "triton" and resolve_attention_backend("cpu") == "cpu"
    monkeypatch.setenv("WEFT_ATTENTION_BACKEND", "torch")
    assert resolve_attention_backend("cuda") == "torch"
    monkeypatch.setenv("WEFT_ATTENTION_BACKEND", "triton")
    assert resolve_attention_backend("cpu") == "triton"
    monkeypatch.setenv("WEFT_ATTENTION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="WEFT_ATTENTION_BACKEND"):
        resolve_attention_backend("cpu")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(backends, "_interpreting", lambda: True)
    assert check_backend("triton", torch.device("cpu")) == "triton"
    monkeypatch.setattr(backends, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        check_backend("triton", torch.device("cpu"))
    assert check_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="one of"):
        check_backend("flash", torch.device("cpu"))
