"""Sharded layers against their unsharded twins, on random weights.

The collective parts run for real: world sizes 2 and 3, one gloo process
per rank (``torch.multiprocessing.spawn``), each rank checking its own
outputs against the full layer computed from the same seeded weights. The
layout arithmetic (which rows a rank keeps) is checked in-process.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from services.config.parallel_args import check_tensor_parallel
from services.worker.distributed import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
)
from services.worker.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    RowSlice,
    even_slices,
    kv_heads_of_rank,
    qkv_slices,
)
from services.worker.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, VocabShard
from services.worker.multiproc_executor import free_tcp_init_method

# (num_heads, num_kv_heads, head_dim): grouped, one KV head per rank, replicated KV heads, MHA.
HEAD_SHAPES = [(4, 2, 8), (6, 3, 4), (6, 2, 4), (4, 1, 8), (6, 1, 4), (6, 6, 2), (12, 4, 4)]
MLP_SHAPES = [(12, 24), (7, 6), (64, 96)]  # (hidden, intermediate)
VOCAB_SIZES = [48, 49, 50]  # divisible by 2, by neither, by 2 only: padding on some ranks


class RecordingSource:
    """A checkpoint tensor that records which parts were read (like a lazy safetensors slice)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape, self.reads = tensor, tuple(tensor.shape), []

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self.reads.append((dim, start, length))
        return self.tensor.narrow(dim, start, length)

    def read_everything(self) -> bool:
        return any(length == self.shape[dim] for dim, _, length in self.reads)


def fits(world_size: int, heads: int, kv_heads: int) -> bool:
    return heads % world_size == 0 and (kv_heads % world_size == 0 or world_size % kv_heads == 0)


def seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- per-rank checks (run inside the spawned gloo processes)


def check_qkv(tp: TensorParallelGroup, heads: int, kv_heads: int, d: int, hidden: int = 16) -> None:
    q_w, k_w, v_w = (
        seeded(rows, hidden, seed=i) for i, rows in enumerate((heads * d, kv_heads * d, kv_heads * d))
    )
    bias = [seeded(w.shape[0], seed=4 + i) for i, w in enumerate((q_w, k_w, v_w))]
    x = seeded(5, hidden, seed=7)
    layer = ColumnParallelLinear(hidden, qkv_slices(heads, kv_heads, d, tp), True, torch.float32)
    sources = [RecordingSource(w) for w in (q_w, k_w, v_w)]
    for part, (source, b) in enumerate(zip(sources, bias)):
        layer.load_weight("weight", source, part)
        layer.load_weight("bias", RecordingSource(b), part)
    assert tp.world_size == 1 or not sources[0].read_everything(), "a rank read the whole q projection"
    q, k, v = layer(x).split(layer.output_sizes, dim=-1)
    full_q, full_k, full_v = (F.linear(x, w, b).view(5, -1, d) for w, b in zip((q_w, k_w, v_w), bias))
    local_heads, local_kv = heads // tp.world_size, k.shape[1] // d
    q, k, v = q.view(5, local_heads, d), k.view(5, local_kv, d), v.view(5, local_kv, d)
    for j in range(local_heads):
        global_head = tp.rank * local_heads + j
        global_kv = global_head // (heads // kv_heads)  # Hugging Face's repeat_kv grouping
        local_kv_head = j // (local_heads // local_kv)  # PagedAttention's grouping on this rank
        torch.testing.assert_close(q[:, j], full_q[:, global_head])
        torch.testing.assert_close(k[:, local_kv_head], full_k[:, global_kv])
        torch.testing.assert_close(v[:, local_kv_head], full_v[:, global_kv])


def check_mlp(tp: TensorParallelGroup, hidden: int, intermediate: int, bias: bool) -> None:
    """gate/up column-parallel -> down row-parallel equals the unsharded MLP on every rank."""
    gate, up = seeded(intermediate, hidden, seed=11), seeded(intermediate, hidden, seed=12)
    down = seeded(hidden, intermediate, seed=13)
    down_bias = seeded(hidden, seed=14)
    x = seeded(6, hidden, seed=15)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down, down_bias if bias else None)
    slices = even_slices([intermediate, intermediate], tp, ["intermediate_size"] * 2)
    gate_up = ColumnParallelLinear(hidden, slices, False, torch.float32)
    gate_up.load_weight("weight", RecordingSource(gate), 0)
    gate_up.load_weight("weight", RecordingSource(up), 1)
    down_proj = RowParallelLinear(intermediate, hidden, bias, torch.float32, tp)
    down_source = RecordingSource(down)
    down_proj.load_weight("weight", down_source, None)
    if bias:
        down_proj.load_weight("bias", RecordingSource(down_bias), None)
    assert tp.world_size == 1 or not down_source.read_everything()
    g, u = gate_up(x).split(slices[0].size, dim=-1)
    # The ranks' partial sums add up in another order than one matmul's.
    torch.testing.assert_close(
        down_proj(F.silu(g) * u), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max())
    )


def check_vocab(tp: TensorParallelGroup, vocab: int, dim: int = 8) -> None:
    table = seeded(vocab, dim, seed=21)
    ids = torch.tensor([0, vocab - 1, 3, vocab // 2, 3, vocab - 2])
    embedding = VocabParallelEmbedding(vocab, dim, torch.float32, tp)
    embedding.load_weight("weight", RecordingSource(table), None)
    assert torch.equal(embedding(ids), F.embedding(ids, table))  # exact: one non-zero row per token
    hidden = seeded(4, dim, seed=22)
    for head in (
        ParallelLMHead(vocab, dim, torch.float32, tp, tied_to=embedding),
        ParallelLMHead(vocab, dim, torch.float32, tp),
    ):
        if head.weight is not embedding.weight:
            head.load_weight("weight", RecordingSource(table), None)
        logits = head.compute_logits(hidden)
        if tp.is_driver:
            torch.testing.assert_close(logits, F.linear(hidden, table))
        else:
            assert logits is None  # gathered on the driver only


def rank_main(rank: int, world_size: int, init_method: str) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world_size, init_method, torch.device("cpu"))
    try:
        tp = get_tp_group()
        for heads, kv_heads, d in HEAD_SHAPES:
            if fits(world_size, heads, kv_heads):
                check_qkv(tp, heads, kv_heads, d)
        for (hidden, intermediate), bias in itertools.product(MLP_SHAPES, (False, True)):
            if intermediate % world_size == 0:
                check_mlp(tp, hidden, intermediate, bias)
        for vocab in VOCAB_SIZES:
            check_vocab(tp, vocab)
        # The collectives themselves.
        x = torch.full((2, 3), float(rank + 1))
        assert torch.equal(tp.all_reduce(x.clone()), torch.full((2, 3), float(sum(range(1, world_size + 1)))))
        gathered = tp.all_gather(torch.tensor([rank]))
        assert gathered.tolist() == list(range(world_size))
        token_ids = torch.tensor([7, 8]) if tp.is_driver else torch.empty(2, dtype=torch.long)
        assert tp.broadcast_from_driver(token_ids).tolist() == [7, 8]
    finally:
        destroy_tensor_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_layers_match_unsharded_over_gloo(world_size):
    torch.multiprocessing.spawn(
        rank_main, args=(world_size, free_tcp_init_method()), nprocs=world_size, join=True
    )


# ---- in-process: the layout, and the same checks with one rank


def test_one_rank_needs_no_process_group():
    tp = TensorParallelGroup()
    for heads, kv_heads, d in HEAD_SHAPES:
        check_qkv(tp, heads, kv_heads, d)
    check_mlp(tp, 12, 24, bias=True)
    check_vocab(tp, 49)


def test_kv_heads_split_or_replicate():
    assert [kv_heads_of_rank(4, TensorParallelGroup(r, 2)) for r in range(2)] == [(2, 0), (2, 2)]
    # 3 KV heads over 3 ranks (the default model): one each.
    assert [kv_heads_of_rank(3, TensorParallelGroup(r, 3)) for r in range(3)] == [(1, 0), (1, 1), (1, 2)]
    # 2 KV heads over 4 ranks: each replicated on the two ranks whose queries read it.
    assert [kv_heads_of_rank(2, TensorParallelGroup(r, 4)) for r in range(4)] == [
        (1, 0),
        (1, 0),
        (1, 1),
        (1, 1),
    ]
    assert qkv_slices(9, 3, 64, TensorParallelGroup(2, 3)) == [
        RowSlice(384, 192),
        RowSlice(128, 64),
        RowSlice(128, 64),
    ]


def test_vocab_rows_pad_the_last_ranks():
    shards = [VocabShard.of_rank(49152, TensorParallelGroup(r, 3)) for r in range(3)]
    assert [(s.start, s.num_rows) for s in shards] == [(0, 16384), (16384, 16384), (32768, 16384)]
    shards = [VocabShard.of_rank(10, TensorParallelGroup(r, 4)) for r in range(4)]
    assert [(s.rows_per_rank, s.start, s.num_rows) for s in shards] == [
        (3, 0, 3),
        (3, 3, 3),
        (3, 6, 3),
        (3, 9, 1),
    ]


def test_heads_that_do_not_split_are_refused_clearly():
    smollm = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    check_tensor_parallel(smollm, 3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) is not divisible.*Sizes that fit: 1, 3"):
        check_tensor_parallel(smollm, 2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tensor_parallel(
            {"num_attention_heads": 8, "num_key_value_heads": 3, "intermediate_size": 64}, 4
        )
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tensor_parallel(
            {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 30}, 4
        )
    with pytest.raises(ValueError, match="num_attention_heads"):
        qkv_slices(9, 3, 64, TensorParallelGroup(0, 2))
    with pytest.raises(ValueError, match="Speculative decoding"):
        check_tensor_parallel(smollm, 3, speculative=True)
