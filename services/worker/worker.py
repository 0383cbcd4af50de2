"""One worker: a device, the model on it, its KV cache and its model runner.

Under tensor parallelism there is one worker per rank, each in its own
process (``services.worker.multiproc_executor``); ``init_device`` joins the
ranks' process group before the model is built, so the model's layers hold
this rank's shard.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from protocol import EngineConfig, ModelRunnerOutput, SchedulerOutput
from protocol.kv_cache_groups import group_windows
from services.config.memory_plan import (
    MemoryPlan,
    engine_share,
    fit_config_max_model_len,
    gib_text,
    node_available_memory_or_none,
    useful_blocks,
)
from services.worker.distributed import destroy_tensor_parallel, init_tensor_parallel
from services.worker.fault_injection import FaultInjector
from services.worker.memory_profiling import (
    GpuSnapshot,
    check_free_memory,
    gpu_kv_budget,
    gpu_snapshot,
    peak_increase,
    rss_bytes,
)
from services.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    # CUDA: the device's memory before the model loaded, and what loading it allocated.
    gpu_start: GpuSnapshot | None = None
    model_bytes = 0

    def __init__(
        self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        """``rank`` is this worker's tensor-parallel rank; with more than one,
        the ranks meet at ``distributed_init_method`` (a ``tcp://`` address)."""
        self.config = config
        self.rank = rank
        self.world_size = config.parallel.tensor_parallel_size
        self.distributed_init_method = distributed_init_method
        kind = config.device.device
        self.device = torch.device(f"cuda:{rank}" if kind == "cuda" else "cpu")
        self.model_runner: ModelRunner | None = None
        self.kv_connector = None  # disaggregated prefill/decode: set with the KV cache
        self.runtime_bytes = 0  # resident bytes before the model loaded (set by load_model)
        self.available_bytes: int | None = None  # the node's memory before this engine (CPU)
        self.faults = FaultInjector.from_env()  # tests only: None unless WEFT_TEST_FAULT_FILE is set

    def init_device(self) -> None:
        if self.device.type == "cuda":
            check_device_visible(self.device, self.world_size)
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            self.gpu_start = gpu_snapshot(self.device)
            cache = self.config.cache
            if cache.kv_cache_memory is None and cache.num_gpu_blocks_override is None:
                check_free_memory(self.gpu_start, cache.gpu_memory_utilization, self.device)
        torch.set_num_threads(self.config.device.num_threads)
        torch.manual_seed(self.config.model.seed)
        init_tensor_parallel(self.rank, self.world_size, self.distributed_init_method, self.device)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        if self.model_runner is None:
            self.init_device()
        if self.model_runner.model is None:
            # What this process holds before its model, and (where its launcher did not measure it)
            # the node's available memory as it was before this process: what the model comes out of.
            self.runtime_bytes = rss_bytes()
            self.available_bytes = self.config.cache.available_memory
            if self.available_bytes is None and self.device.type == "cpu":
                measured = node_available_memory_or_none()
                self.available_bytes = None if measured is None else measured + self.runtime_bytes
            start = time.monotonic()
            logger.info("Loading the weights of %s ...", self.config.model.model)
            allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            self.model_runner.load_model()
            if self.device.type == "cuda":  # parameters and buffers (rotary tables) alike
                self.model_bytes = torch.cuda.memory_allocated(self.device) - allocated
            logger.info("Loaded the weights in %.1f s.", time.monotonic() - start)

    def determine_num_blocks(self) -> int:
        """KV blocks that fit, block 0 (the null block) included.

        The KV cache's bytes (``kv_budget``) over the bytes of one block, no more than
        ``max_num_seqs`` sequences of ``max_model_len`` can use; one sequence of the
        context the engine will serve must fit (``fit_config_max_model_len``).
        ``num_gpu_blocks_override`` skips the profiling.
        """
        self.load_model()
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return _check_override(cache.num_gpu_blocks_override)
        runner = self.model_runner
        start = time.monotonic()
        logger.info("Sizing the KV cache (one profiled step) ...")
        peak = self.activation_peak()
        kv_bytes, source = self.kv_budget(peak)
        num_blocks, source = self._capped(max(0, kv_bytes) // runner.kv_block_bytes, source)
        plan = self._memory_plan(source, peak, num_blocks)
        try:
            context = fit_config_max_model_len(self.config, num_blocks, runner.kv_block_bytes)
        except ValueError as e:
            raise ValueError(f"{e} {plan.describe()}") from None
        logger.info(
            "KV cache sized in %.1f s: %s",
            time.monotonic() - start,
            dataclasses.replace(plan, max_model_len=context).describe(),
        )
        return num_blocks

    def activation_peak(self) -> int:
        """Bytes the largest step adds above the loaded model, profiled.

        On a GPU the whole step runs. On a CPU a step of max_num_batched_tokens is as slow as the
        longest prefill (tens of seconds for a 1B model on 2 cores, at every start), so the forward
        runs on ``CPU_PROFILE_TOKENS`` tokens through one layer of each kind (the peak is one
        layer's) and its peak is scaled to the step's tokens (a step's activations grow linearly
        with its tokens: attention is paged, never T x T), and the logits and sampling run at their
        full rows (the LM head itself on ``CPU_PROFILE_LOGIT_ROWS``, its logits tiled to the rest)."""
        runner, tokens = self.model_runner, self.config.scheduler.max_num_batched_tokens
        if self.device.type != "cpu" or tokens <= CPU_PROFILE_TOKENS:
            return peak_increase(runner.profile_run, self.device)
        forward = peak_increase(lambda: runner.profile_forward(CPU_PROFILE_TOKENS), self.device)
        sampling = peak_increase(lambda: runner.profile_sampling(CPU_PROFILE_LOGIT_ROWS), self.device)
        return -(-forward * tokens // CPU_PROFILE_TOKENS) + sampling

    def _capped(self, num_blocks: int, source: str) -> tuple[int, str]:
        """No more blocks than the scheduler could ever use, where the budget is the machine's (CPU)."""
        if self.config.cache.kv_cache_memory is not None or self.device.type != "cpu":
            return num_blocks, source
        scheduler, model, cache = self.config.scheduler, self.config.model, self.config.cache
        useful = useful_blocks(
            scheduler.max_num_seqs,
            model.max_model_len,
            cache.block_size,
            group_windows(model),
            scheduler.max_num_batched_tokens,
        )
        if num_blocks <= useful:
            return num_blocks, source
        return useful, f"{source}, capped at what {scheduler.max_num_seqs} sequences can use"

    def _memory_plan(self, source: str, activation_peak: int, num_blocks: int) -> MemoryPlan:
        runner = self.model_runner
        packed, dense, other = runner.weights_by_kind
        return MemoryPlan(
            source=source,
            runtime=self.runtime_bytes if self.device.type == "cpu" else 0,  # host memory: not the GPU's
            weights_packed=packed,
            weights_dense=dense,
            weights_other=other,
            activation_peak=activation_peak,
            num_blocks=num_blocks,
            block_size=self.config.cache.block_size,
            block_bytes=runner.kv_block_bytes,
            kv_dtype="int8 with per-token scales"
            if runner.kv_int8
            else str(runner.dtype).removeprefix("torch."),
            max_model_len=self.config.model.max_model_len,
            native_max_model_len=self.config.model.max_model_len,
        )

    def kv_budget(self, activation_peak: int) -> tuple[int, str]:
        """Bytes for this worker's KV cache, and how they were chosen (in words, for the plan)."""
        cache, runner = self.config.cache, self.model_runner
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory, f"--kv-cache-memory {gib_text(cache.kv_cache_memory)}"
        if self.device.type == "cuda":
            # The graphs are captured after the cache, into a pool of their own: budget it now.
            graph_pool = (
                peak_increase(runner.profile_decode_graph, self.device) if runner.captures_graphs else 0
            )
            budget = gpu_kv_budget(
                self.gpu_start or gpu_snapshot(self.device),
                gpu_snapshot(self.device),
                utilization=cache.gpu_memory_utilization,
                weights=max(self.model_bytes, runner.weights_bytes),
                activation_peak=activation_peak,
                graph_pool=graph_pool,
            )
            return budget.kv, budget.describe(cache.gpu_memory_utilization)
        if self.available_bytes is None:
            raise ValueError(
                "The memory available on this machine could not be read (/proc/meminfo): "
                "give the KV cache's bytes with --kv-cache-memory."
            )
        processes = cache.engines_on_node * self.world_size
        share = engine_share(self.available_bytes, cache.cpu_memory_utilization, processes)
        kv = share - self.runtime_bytes - runner.weights_bytes - activation_peak
        return kv, (
            f"{gib_text(self.available_bytes)} available at start x {cache.cpu_memory_utilization} / "
            f"{processes} engine process(es) = {gib_text(share)} for this one"
        )

    def initialize_cache(self, num_blocks: int) -> None:
        self.load_model()
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.config.kv_transfer is not None:
            from services.kv_transfer.factory import create_worker_connector

            self.kv_connector = create_worker_connector(self.config, self.model_runner.kv_caches)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.faults is not None:
            self.faults.before_step(scheduler_output)
        if self.kv_connector is not None:
            from services.kv_transfer.worker_step import execute_with_kv_connector

            return execute_with_kv_connector(
                self.kv_connector, scheduler_output, self.model_runner.execute_model
            )
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None
        self.model_runner = None
        if self.world_size > 1:
            destroy_tensor_parallel()


# Tokens of the forward profiled on CPU (Worker.activation_peak).
CPU_PROFILE_TOKENS = 128
# Rows the CPU profile runs the LM head on; its logits are tiled to the step's rows for sampling.
CPU_PROFILE_LOGIT_ROWS = 8


def check_device_visible(device: torch.device, tensor_parallel_size: int) -> None:
    """A clear error where a worker's GPU is past the visible ones (CUDA says "invalid device ordinal")."""
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"This worker runs on {device}, but {count} GPU(s) are visible (tensor_parallel_size "
            f"{tensor_parallel_size}, one GPU per worker; CUDA_VISIBLE_DEVICES selects them). Lower "
            "--tensor-parallel-size (or the data-parallel ranks on this node), or make more GPUs visible."
        )


def _check_override(num_blocks: int) -> int:
    if num_blocks < 2:
        raise ValueError(
            f"num_gpu_blocks_override must be at least 2 (the null block and one block), got {num_blocks}."
        )
    return num_blocks
