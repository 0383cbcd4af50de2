"""Executor <-> worker messages: one engine core and its tensor-parallel workers.

The executor broadcasts each ``WorkerCall`` once to every worker. A step
(``ExecuteModel``) is answered by the driver with its output, and by another
rank only if it failed there; every other call is answered by every rank.
So a failure on any rank reaches the executor. Field order is the wire contract (``array_like``):
append new fields at the end, with defaults.
"""

from __future__ import annotations

import msgspec

from protocol.scheduler import ModelRunnerOutput, SchedulerOutput


class DetermineNumBlocks(msgspec.Struct, tag="num_blocks", array_like=True, gc=False):
    """Load the model, profile a step, and answer how many KV blocks fit on this rank."""


class InitializeCache(msgspec.Struct, tag="init_cache", array_like=True, gc=False):
    num_blocks: int


class ExecuteModel(msgspec.Struct, tag="execute", array_like=True, gc=False):
    scheduler_output: SchedulerOutput


class StopWorker(msgspec.Struct, tag="stop", array_like=True, gc=False):
    """Leave the loop and exit; no reply."""


WorkerCall = DetermineNumBlocks | InitializeCache | ExecuteModel | StopWorker


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One worker's answer to one call (its first reply says it started).

    ``error`` set: the call failed on this rank; ``error_type`` is the
    exception's class name, so a ValueError (bad configuration) can be
    raised as one in the engine core.
    """

    rank: int
    num_blocks: int | None = None
    output: ModelRunnerOutput | None = None
    error: str | None = None
    error_type: str | None = None
