"""One worker: a device, the model on it, its KV cache and its model runner.

Under tensor parallelism there is one worker per rank, each in its own
process (``services.worker.multiproc_executor``); ``init_device`` joins the
ranks' process group before the model is built, so the model's layers hold
this rank's shard.
"""

from __future__ import annotations

import logging

import torch

from protocol import EngineConfig, ModelRunnerOutput, SchedulerOutput
from protocol.config import CPU_DEFAULT_BUDGET
from services.worker.distributed import destroy_tensor_parallel, init_tensor_parallel
from services.worker.memory_profiling import peak_increase, total_budget
from services.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
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

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.set_num_threads(self.config.device.num_threads)
        torch.manual_seed(self.config.model.seed)
        init_tensor_parallel(self.rank, self.world_size, self.distributed_init_method, self.device)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        if self.model_runner is None:
            self.init_device()
        if self.model_runner.model is None:
            self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """KV blocks that fit, block 0 (the null block) included.

        Budget (``kv_cache_memory``, else 2 GiB on CPU or
        ``gpu_memory_utilization`` of the GPU) minus the weights minus the
        peak of a profiling step at ``max_num_batched_tokens``, over the
        bytes of one block. ``num_gpu_blocks_override`` skips the profiling.
        """
        self.load_model()
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return _check_override(cache.num_gpu_blocks_override)
        runner = self.model_runner
        budget = total_budget(self.device, cache.kv_cache_memory, cache.gpu_memory_utilization)
        peak = peak_increase(runner.profile_run, self.device)
        num_blocks = kv_blocks_from_memory(budget, runner.weights_bytes, peak, runner.kv_block_bytes)
        logger.info(
            "KV cache: %d blocks of %s (budget %d B, weights %d B, profiled peak %d B, %d B per block)",
            num_blocks,
            "int8 with per-token scales" if runner.kv_int8 else runner.dtype,
            budget,
            runner.weights_bytes,
            peak,
            runner.kv_block_bytes,
        )
        _check_fits_one_sequence(
            num_blocks, self.config, budget, runner.weights_bytes, peak, runner.kv_block_bytes
        )
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        self.load_model()
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.config.kv_transfer is not None:
            from services.kv_transfer.factory import create_worker_connector

            self.kv_connector = create_worker_connector(self.config, self.model_runner.kv_caches)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
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


def kv_blocks_from_memory(budget: int, weights: int, activation_peak: int, block_bytes: int) -> int:
    return max(0, (budget - weights - activation_peak) // block_bytes)


def _check_override(num_blocks: int) -> int:
    if num_blocks < 2:
        raise ValueError(
            f"num_gpu_blocks_override must be at least 2 (the null block and one block), got {num_blocks}."
        )
    return num_blocks


def _check_fits_one_sequence(num_blocks, config: EngineConfig, budget, weights, peak, block_bytes) -> None:
    """One max_model_len sequence must fit, or the scheduler could never finish it."""
    needed = -(-config.model.max_model_len // config.cache.block_size) + 1  # + the null block
    if num_blocks >= needed:
        return
    in_all = weights + peak + needed * block_bytes
    raise ValueError(
        f"The KV cache is too small: {num_blocks} blocks fit, but one sequence of max_model_len "
        f"({config.model.max_model_len}) needs {needed} (with the null block), i.e. "
        f"{in_all} bytes in all; the budget is {budget} bytes "
        f"(weights {weights}, activation peak {peak}, {block_bytes} bytes per block). "
        + budget_advice(config, in_all)
    )


def budget_advice(config: EngineConfig, needed_bytes: int) -> str:
    """Which flag to raise, and to what: the budget holds the weights too."""
    cache = config.cache
    if config.device.device != "cuda" and cache.kv_cache_memory is None:
        at_least = -(-needed_bytes // (1 << 30))  # whole GiB, rounded up
        return (
            f"On CPU the default budget is {CPU_DEFAULT_BUDGET >> 30} GiB for the weights, activations and "
            f"KV cache together: raise it with --kv-cache-memory (bytes; at least {at_least} GiB = "
            f"{at_least << 30} here), or lower --max-model-len."
        )
    if config.device.device == "cuda" and cache.kv_cache_memory is None:
        return "Raise --gpu-memory-utilization (the share of the GPU's memory), or lower --max-model-len."
    return f"Raise --kv-cache-memory (now {cache.kv_cache_memory} bytes), or lower --max-model-len."
