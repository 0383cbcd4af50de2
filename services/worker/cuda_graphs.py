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
there are none. Nor under tensor parallelism (the graphs would record
torch.distributed's NCCL all-reduces, a known failure path: vLLM captures a
communicator of its own) or with several KV cache groups (the replay holds
one block table). A capture that raises leaves the engine eager, logged.
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
    """vLLM's list: 1, 2, 4, the multiples of 8 below 256, then every 16th size from 256, up to
    max_num_seqs (itself included, so the largest batch replays too)."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, MAX_CAPTURE_SIZE + 1, 16)]
    return sorted({s for s in sizes if s <= limit} | {limit})


def graphs_wanted(
    device: torch.device, backend: str, enforce_eager: bool, tp_size: int = 1, kv_groups: int = 1
) -> bool:
    """Whether decode steps are captured (the module notes say when they are not)."""
    return (
        device.type == "cuda"
        and backend == "triton"
        and not enforce_eager
        and tp_size == 1
        and kv_groups <= 1
    )


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
    tp_size: int = 1,
    kv_groups: int = 1,
    runner_class: type[CudaGraphRunner] = CudaGraphRunner,
) -> CudaGraphRunner | None:
    """Captured graphs on a CUDA device with the Triton backend, one worker and one KV cache group;
    None elsewhere, with enforce_eager, or when capturing raised (logged: the engine runs eagerly)."""
    if not graphs_wanted(device, backend, enforce_eager, tp_size, kv_groups):
        if device.type == "cuda" and backend == "triton" and not enforce_eager:
            logger.info(
                "Decode CUDA graphs off: %s; decode steps run eagerly.",
                "tensor parallel" if tp_size > 1 else "several KV cache groups (sliding-window layers)",
            )
        return None
    runner = runner_class(
        model,
        kv_caches,
        sizes=capture_sizes(max_num_seqs),
        block_size=block_size,
        max_blocks_per_seq=-(-max_model_len // block_size),
        device=device,
    )
    try:
        runner.capture()
    except Exception as exc:  # a capture failure costs speed, never the engine
        logger.warning(
            "CUDA graph capture failed (%s: %s); decode steps run eagerly (--enforce-eager skips the "
            "attempt).",
            type(exc).__name__,
            exc,
        )
        runner.graphs.clear()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        return None
    return runner
