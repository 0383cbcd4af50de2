"""How an engine core drives its workers.

The engine core sees only this interface; ``UniProcExecutor`` runs one
worker in the engine-core process, and a multi-process executor (one worker
process per device, tensor parallel) plugs in behind the same methods.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable

from protocol import EngineConfig, ModelRunnerOutput, SchedulerOutput

# "module:Class" of the worker an executor runs; benchmarks and tests swap in
# a model-free one to measure or exercise the executor alone.
DEFAULT_WORKER_CLASS = "services.worker.worker:Worker"


def import_worker_class(path: str) -> type:
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


class Executor(ABC):
    # Whether the engine may go on after ``execute_model`` raised an allocation
    # failure: true where the one worker is in this process (its batch takes the
    # requests back as the next step says); tensor-parallel ranks that failed apart
    # may be stuck in a collective, so their engine stops instead.
    survives_step_errors = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """Load the model, profile a forward, and return how many KV blocks fit.

        The count includes block 0, which the block pool keeps as a null
        block. ``cache.num_gpu_blocks_override`` wins when set.
        """

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache with exactly ``num_blocks`` blocks."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update the batch, forward, sample."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers; safe to call twice."""

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Have ``callback(reason)`` called, from another thread, if the workers
        die between calls. Workers in this process cannot die on their own:
        the default never calls it."""


class UniProcExecutor(Executor):
    """One worker, in the engine-core process: no IPC on the step path."""

    survives_step_errors = True

    def __init__(self, config: EngineConfig, worker_class: str = DEFAULT_WORKER_CLASS) -> None:
        super().__init__(config)
        # Imported here: torch is loaded only by executors that need it.
        self.worker = import_worker_class(worker_class)(config, rank=0)
        self.worker.init_device()

    def determine_num_blocks(self) -> int:
        return self._worker().determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self._worker().initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._worker().execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None

    def _worker(self):
        if self.worker is None:
            raise RuntimeError("The executor was shut down.")
        return self.worker
