"""Decode steps as CUDA graphs: captured once per batch size, replayed every step.

A decode step of a small model launches a few hundred short kernels; on a
GPU the launches, not the math, set its time. A CUDA graph records the
launches once and replays them with one call. It replays fixed addresses,
so the model reads its inputs from static buffers that each step copies
into, and the batch is padded up to the nearest captured size: padding rows
write no K/V (slot -1) and attend to one key of the null block.

Only the Triton backend is captured: its metadata has shapes that depend on
the batch size alone, and its decode split count likewise, so one graph
per size serves any sequence lengths. Steps that are not pure decode
(prefill chunks, speculative verification) and batches larger than the
largest size run eagerly. ``--enforce-eager`` turns graphs off; on CPU
there are none.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from services.worker.forward_context import set_forward_context
from services.worker.layers.triton_attention import TritonAttentionMetadata

logger = logging.getLogger(__name__)

# Largest decode batch captured: beyond it the launch overhead is small next to the work.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to max_num_seqs (itself included)."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    return sorted(set(sizes) | {limit})


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        sizes: list[int],
        block_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.block_size = block_size
        n = self.sizes[-1]
        # Static inputs. Rows past a step's batch keep the padding values set here.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per row
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (a smaller graph reuses the larger's memory)."""
        start, pool = time.perf_counter(), None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles this size's kernels outside the capture
            graph, hidden = self._capture_one(size, pool)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        logger.info(
            "Captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def _capture_one(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        torch.cuda.synchronize(self.input_ids.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self._forward(size)
        return graph, hidden

    def _forward(self, size: int) -> torch.Tensor:
        meta = TritonAttentionMetadata(
            num_tokens=size,
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            max_query_len=1,
        )
        with set_forward_context(meta, self.kv_caches, "triton"):
            return self.model(self.input_ids[:size], self.positions[:size])  # [size, hidden]

    def can_replay(self, meta) -> bool:
        """A pure decode step (one token per request) of a batch no larger than the largest graph."""
        return (
            isinstance(meta, TritonAttentionMetadata)
            and meta.max_query_len == 1
            and meta.num_tokens == meta.num_reqs <= self.sizes[-1]
            and meta.block_table.shape[1] <= self.block_table.shape[1]
        )

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: TritonAttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of the step; valid until the next replay."""
        n = meta.num_reqs
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)  # padding rows write nothing
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.block_table[:n, : meta.block_table.shape[1]].copy_(meta.block_table)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:n]


def maybe_capture_decode_graphs(
    model: nn.Module,
    kv_caches: list[torch.Tensor],
    *,
    backend: str,
    enforce_eager: bool,
    max_num_seqs: int,
    block_size: int,
    max_model_len: int,
    device: torch.device,
) -> CudaGraphRunner | None:
    """Captured graphs on a CUDA device with the Triton backend; None elsewhere or with enforce_eager."""
    if device.type != "cuda" or enforce_eager or backend != "triton":
        return None
    runner = CudaGraphRunner(
        model,
        kv_caches,
        sizes=capture_sizes(max_num_seqs),
        block_size=block_size,
        max_blocks_per_seq=-(-max_model_len // block_size),
        device=device,
    )
    runner.capture()
    return runner
