"""EngineCore: one data-parallel rank's scheduler, KV cache and executor.

``step()`` is the whole engine: schedule -> execute -> update_from_output
(with async scheduling, the next step is scheduled while one executes:
``async_scheduling.py``).
The offline ``LLM`` calls it in a loop in-process; the engine-core process
(serving) calls it from its busy loop between socket reads.
"""

from __future__ import annotations

import logging
import time

from protocol import EngineConfig, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, ModelRunnerOutput
from services.config.async_scheduling_args import check_async_scheduling
from services.config.engine_args import with_max_model_len
from services.config.engine_device import resolve_engine_device
from services.config.memory_plan import fit_config_max_model_len
from services.engine_core.async_scheduling import StepPipeline, reaches_workers
from services.engine_core.kv_events import ZmqEventPublisher, make_publisher
from services.engine_core.request import Request, RequestStatus
from services.engine_core.scheduler import Scheduler
from services.engine_core.stats_logger import EngineStatsLogger
from services.worker.executor import Executor
from services.worker.executor_factory import executor_class_for

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        config = resolve_engine_device(config)  # the API's "auto" decided here, where the model runs
        check_async_scheduling(config)
        if executor_class is None:
            executor_class = executor_class_for(config)  # worker processes when tensor parallel
        self.config = config
        self.executor = executor_class(config)
        start = time.perf_counter()
        try:
            self.num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()  # worker processes must not outlive a failed start
            raise
        logger.info(
            "KV cache: %d blocks of %d tokens (sized in %.1fs)",
            self.num_blocks,
            config.cache.block_size,
            time.perf_counter() - start,
        )
        try:
            config = self.config = fitted_config(config, self.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(config, self.num_blocks)
        self.engine_index = config.parallel.data_parallel_rank
        self.stats_logger = EngineStatsLogger(self.engine_index, spec_decode=config.speculative is not None)
        self.kv_event_publisher = self._start_kv_events(config)
        # Async scheduling: steps run on a thread of their own, one scheduled ahead.
        self.pipeline = StepPipeline(self.executor) if config.scheduler.async_scheduling else None

    def _start_kv_events(self, config: EngineConfig) -> ZmqEventPublisher | None:
        if config.kv_events is None or not config.kv_events.enable_kv_cache_events:
            return None
        medium = "GPU" if config.device.device == "cuda" else "CPU"
        self.scheduler.kv_cache_manager.block_pool.enable_kv_events(
            config.cache.block_size, medium, token_ids=config.kv_events.include_token_ids
        )
        return make_publisher(config.kv_events, self.engine_index)

    def publish_kv_events(self) -> None:
        """Send what the block pool recorded since the last call, as one batch."""
        events = self.scheduler.kv_cache_manager.block_pool.take_kv_events()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(events)

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Refuse a request the engine cannot serve, before it costs anything
        (the one check in the engine; the scheduler trusts it)."""
        check_request(request, self.config.model.max_model_len, self.config.model.vocab_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.validate_request(request)
        self.scheduler.add_request(Request.from_engine_core_request(request, self.scheduler.block_hasher))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or (async scheduling) a step in flight whose output is not collected."""
        return self.scheduler.has_unfinished_requests() or bool(self.pipeline)

    def has_work(self) -> bool:
        """A step would make progress: requests wait and scheduling is not paused, or a step is in flight."""
        return (self.scheduler.has_unfinished_requests() and not self.scheduler.paused) or bool(self.pipeline)

    # ---- utility calls (the API's management endpoints)

    def pause(self) -> bool:
        """Stop scheduling; every request keeps its place (and its KV blocks) until ``resume``."""
        self.scheduler.paused = True
        return True

    def resume(self) -> bool:
        self.scheduler.paused = False
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while any block is in use."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def step(self) -> EngineCoreOutputs:
        outputs = self._step() if self.pipeline is None else self._async_step()
        self.publish_kv_events()  # once per step, after update_from_output (and after idle resets)
        return outputs

    def _step(self) -> EngineCoreOutputs:
        if not self.has_work():
            return EngineCoreOutputs(
                engine_index=self.engine_index, scheduler_stats=self.scheduler.make_stats()
            )
        scheduler_output = self.scheduler.schedule()
        # A step with no tokens still reaches the workers when it drops requests
        # (finished, preempted), or while KV transfers are in flight (the plan
        # is set): they report the transfers that finished.
        if not reaches_workers(scheduler_output) and scheduler_output.kv_connector_metadata is None:
            runner_output = ModelRunnerOutput()
        else:
            try:
                runner_output = self.executor.execute_model(scheduler_output)
            except Exception as e:
                if not (self.executor.survives_step_errors and is_allocation_failure(e)):
                    raise  # the engine stops: the API fails its requests and restarts it
                logger.warning(
                    "A step failed to allocate memory (%s: %s); failing its request.", type(e).__name__, e
                )
                self.scheduler.fail_step(scheduler_output, f"{type(e).__name__}: {e}")
                return self._batch(self.scheduler.take_error_outputs())
        return self._batch(self.scheduler.update_from_output(scheduler_output, runner_output))

    def _async_step(self) -> EngineCoreOutputs:
        """Keep two steps in flight, then collect the oldest: step N+1 is scheduled while N runs."""
        pipeline = self.pipeline
        assert pipeline is not None, "async scheduling only"
        outputs: list[EngineCoreOutput] = []
        scheduler = self.scheduler
        while not pipeline.full and scheduler.has_unfinished_requests() and not scheduler.paused:
            scheduler_output = scheduler.schedule()
            if not reaches_workers(scheduler_output):
                # Nothing runs; requests that failed outside a step (grammars) still report.
                outputs += scheduler.update_from_output(scheduler_output, ModelRunnerOutput())
                break
            scheduled = {
                request_id: scheduler.requests[request_id]
                for request_id in scheduler_output.num_scheduled_tokens
            }
            pipeline.submit(scheduler_output, scheduled)
        if not pipeline and not outputs:
            return EngineCoreOutputs(engine_index=self.engine_index, scheduler_stats=scheduler.make_stats())
        if pipeline:
            step, runner_output = pipeline.pop_oldest()
            outputs += scheduler.update_from_output(step.scheduler_output, runner_output, step.requests)
        return self._batch(outputs)

    def _batch(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        stats = self.scheduler.make_stats()
        self.stats_logger.observe(stats, sum(len(o.new_token_ids) for o in outputs))
        batch = EngineCoreOutputs(engine_index=self.engine_index, outputs=outputs, scheduler_stats=stats)
        for output in outputs:
            output.timestamp, output.engine_index = batch.timestamp, self.engine_index
        return batch

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        if self.pipeline is not None:
            self.pipeline.shutdown()
        self.executor.shutdown()
        self.scheduler.structured_output_manager.shutdown()


def is_allocation_failure(error: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, torch's OutOfMemoryError (CUDA), or
    the CPU allocator's RuntimeError. Torch-free: matched by name and message."""
    if isinstance(error, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(error).__mro__):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def check_request(request: EngineCoreRequest, max_model_len: int, vocab_size: int) -> None:
    """ValueError for a request no engine can serve: an empty prompt, one with
    no room left for output (a pooling request's may fill the context), token ids outside the vocabulary, or n > 1."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise ValueError("The prompt is empty; it must have at least one token.")
    if request.pooling_params is not None:
        # Prompt-only: it may fill the context, nothing is generated after it.
        if len(prompt) > max_model_len:
            raise ValueError(
                f"The prompt has {len(prompt)} tokens, more than max_model_len ({max_model_len})."
            )
    elif len(prompt) >= max_model_len:
        raise ValueError(
            f"The prompt has {len(prompt)} tokens, but max_model_len is {max_model_len}: "
            f"a prompt must be shorter than {max_model_len} tokens to leave room for output."
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"Prompt token ids must be in [0, {vocab_size}).")
    if request.sampling_params.n != 1:
        raise ValueError("The engine core takes n=1 requests; the front end fans out n > 1.")


def fitted_config(config: EngineConfig, num_blocks: int) -> EngineConfig:
    """``config`` with the context ``num_blocks`` KV blocks serve: its max_model_len, or less when
    that was the model's own and does not fit (``fit_config_max_model_len``; a ValueError when nothing
    useful fits, or an explicit max_model_len does not)."""
    model, cache = config.model, config.cache
    context = fit_config_max_model_len(config, num_blocks)
    if context == model.max_model_len:
        return config
    logger.warning(
        "max_model_len %d -> %d: the KV cache holds %s tokens on this machine; pass --max-model-len to choose.",
        model.max_model_len,
        context,
        f"{(num_blocks - 1) * cache.block_size:,}",
    )
    return with_max_model_len(config, context)
