"""Decode-step graphs: padding, static buffers and replay against eager forwards.

On CPU an eager stand-in replaces the CUDA graph: a real graph replays the
recorded kernels on the static buffers, the stand-in re-runs the same
forward on the same buffers, so everything the runner itself does (copying
a step in, padding to the captured size, keeping padding rows out of the
cache) is checked here too. On a GPU the same test captures real graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.cuda_graphs import CudaGraphRunner, capture_sizes, maybe_capture_decode_graphs
from services.worker.dummy_weights import fill_dummy_weights
from services.worker.forward_context import set_forward_context
from services.worker.layers.attention import kv_cache_shape
from services.worker.layers.attention_metadata import build_attention_metadata
from services.worker.layers.triton_attention import build_triton_metadata
from services.worker.models.llama import LlamaArgs, LlamaForCausalLM

BS, MAX_LEN, NUM_BLOCKS = 16, 128, 40
ARGS = LlamaArgs(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=192,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=MAX_LEN,
    tie_word_embeddings=True,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    sliding_window=None,
)


class EagerReplay:
    """Stands in for a CUDAGraph: replay recomputes into the captured output tensor."""

    def __init__(self, run, out: torch.Tensor) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        self.out.copy_(self.run())

    def pool(self) -> None:
        return None


class CpuGraphRunner(CudaGraphRunner):
    def _capture_one(self, size, pool):
        hidden = self._forward(size)
        return EagerReplay(lambda: self._forward(size), hidden), hidden


@pytest.fixture
def model(device):
    with torch.device(device):
        return fill_dummy_weights(LlamaForCausalLM(ARGS, MAX_LEN), seed=0).eval()


def decode_step(contexts, tables, gen, device):
    """Inputs of one decode token per request after ``contexts`` cached tokens."""
    n = len(contexts)
    block_table = np.zeros((n, MAX_LEN // BS), dtype=np.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = t
    positions = np.array(contexts)
    slots = block_table[np.arange(n), positions // BS].astype(np.int64) * BS + positions % BS
    meta = build_triton_metadata(
        query_lens=np.ones(n, np.int64),
        context_lens=positions,
        block_table=block_table,
        slot_mapping=slots,
        block_size=BS,
        device=device,
    )
    ids = torch.randint(0, ARGS.vocab_size, (n,), generator=gen)
    return ids.to(device), torch.from_numpy(positions).to(device), meta


def fill_cache(model, caches, contexts, tables, gen, device):
    """Prefill each request's context into the cache (Triton backend, eagerly)."""
    for context, blocks in zip(contexts, tables):
        table = np.array([blocks + [0] * (MAX_LEN // BS - len(blocks))], dtype=np.int32)
        positions = np.arange(context)
        slots = table[0, positions // BS].astype(np.int64) * BS + positions % BS
        meta = build_triton_metadata(
            query_lens=np.array([context]),
            context_lens=np.array([0]),
            block_table=table,
            slot_mapping=slots,
            block_size=BS,
            device=device,
        )
        ids = torch.randint(0, ARGS.vocab_size, (context,), generator=gen)
        with set_forward_context(meta, caches, "triton"):
            model(ids.to(device), torch.from_numpy(positions).to(device))


@torch.inference_mode()
def test_replay_pads_and_matches_eager(model, generator, close, device):
    shape = kv_cache_shape(NUM_BLOCKS, BS, ARGS.num_kv_heads, ARGS.head_dim)
    caches = [torch.zeros(shape, device=device) for _ in range(ARGS.num_layers)]
    contexts, tables = [20, 3, 40], [[7, 2], [11], [30, 4, 19]]
    fill_cache(model, caches, contexts, tables, generator, device)
    runner = CudaGraphRunner if device.type == "cuda" else CpuGraphRunner
    graphs = runner(
        model, caches, sizes=[2, 4], block_size=BS, max_blocks_per_seq=MAX_LEN // BS, device=device
    )
    graphs.capture()
    eager_caches = [c.clone() for c in caches]
    for batch in ([0, 1, 2], [1]):  # padded to 4, then to 2 over a row the first step filled
        ids, positions, meta = decode_step(
            [contexts[i] for i in batch], [tables[i] for i in batch], generator, device
        )
        assert graphs.can_replay(meta)
        before = [c.clone() for c in caches]
        replayed = graphs.replay(ids, positions, meta).clone()
        with set_forward_context(meta, eager_caches, "triton"):
            eager = model(ids, positions)
        close(replayed, eager, torch.float32)  # a padded batch rounds its matmuls a little differently
        for cache, eager_cache, old in zip(caches, eager_caches, before):
            close(cache, eager_cache, torch.float32)
            written = (cache != old).any(-1).flatten(2).any(0).any(0)  # [blocks * block_size]
            assert torch.nonzero(written).flatten().tolist() == sorted(
                meta.slot_mapping.tolist()
            )  # no padding row
        for i in batch:
            contexts[i] += 1


def test_only_pure_decode_steps_of_captured_sizes_replay(model):  # no capture: metadata checks only
    graphs = CpuGraphRunner(
        model,
        [],
        sizes=[1, 2, 4],
        block_size=BS,
        max_blocks_per_seq=MAX_LEN // BS,
        device=torch.device("cpu"),
    )
    one_block = np.ones((5, 1), np.int32)

    def meta(query_lens, build=build_triton_metadata):
        q = np.array(query_lens)
        return build(
            query_lens=q,
            context_lens=np.full(len(q), 3),
            block_table=one_block[: len(q)],
            slot_mapping=np.arange(q.sum()),
            block_size=BS,
        )

    assert graphs.can_replay(meta([1, 1, 1]))
    assert not graphs.can_replay(meta([1, 1, 1, 1, 1]))  # larger than the largest graph
    assert not graphs.can_replay(meta([1, 3]))  # a chunk or speculative verification
    assert not graphs.can_replay(meta([1, 1], build_attention_metadata))  # the torch backend


def test_sizes_and_when_graphs_are_off(model):
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(10_000)[-1] == 512
    common = dict(max_num_seqs=8, block_size=BS, max_model_len=MAX_LEN)
    assert (
        maybe_capture_decode_graphs(
            model, [], backend="triton", enforce_eager=False, device=torch.device("cpu"), **common
        )
        is None
    )
    cuda = torch.device("cuda")  # nothing is allocated when graphs are off
    assert (
        maybe_capture_decode_graphs(model, [], backend="triton", enforce_eager=True, device=cuda, **common)
        is None
    )
    assert (
        maybe_capture_decode_graphs(model, [], backend="torch", enforce_eager=False, device=cuda, **common)
        is None
    )
