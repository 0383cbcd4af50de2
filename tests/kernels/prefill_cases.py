"""Paged-prefill test cases shared by the CPU prefill kernel's tests."""

from __future__ import annotations

import torch


def prefill_case(gen, shapes, num_heads, num_kv_heads, head_dim, dtype, gap=2, block_size=16):
    """Sequences of (context, new) tokens over blocks in random order; each sequence's query
    rows sit in one flat batch with ``gap`` foreign rows before each (a decode's, say)."""
    per_seq = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = sum(per_seq) + 3
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(shapes), max(per_seq), dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        table[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    starts, row = [], 0
    for _, n in shapes:
        starts.append(row + gap)
        row += gap + n
    qkv = torch.randn(row, (num_heads + 2) * head_dim, generator=gen).to(dtype)
    query = qkv[:, : num_heads * head_dim].view(row, num_heads, head_dim)  # a view, as the model's q
    return (
        query,
        cache,
        torch.tensor(starts),
        torch.tensor([n for _, n in shapes], dtype=torch.int32),
        torch.tensor([c for c, _ in shapes], dtype=torch.int32),
        table,
    )
