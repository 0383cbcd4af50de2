"""Which executor an engine core runs. Kept apart from ``executor.py``, whose
base class the multi-process executor imports, so neither imports the other."""

from __future__ import annotations

from protocol import EngineConfig
from services.worker.executor import Executor, UniProcExecutor


def executor_class_for(config: EngineConfig) -> type[Executor]:
    """In-process for one device; worker processes for tensor parallelism."""
    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor
    # Imported late: its worker processes' machinery is not needed for one device.
    from services.worker.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor
