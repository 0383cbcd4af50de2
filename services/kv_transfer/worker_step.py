"""One engine step of a worker with a KV connector, in vLLM's order:
bind the plan -> start loads -> forward (``execute``) -> start saves ->
report finished transfers -> clear the plan.

A step that runs no forward only polls for finished transfers; it waits a
little for one (``IDLE_POLL_S``), so an engine with nothing to do but wait
for KV does not spin.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol import ModelRunnerOutput, SchedulerOutput
from protocol.kv_transfer import KVConnectorMetadata
from services.kv_transfer.base import KVConnectorBase

IDLE_POLL_S = 0.02


def execute_with_kv_connector(
    connector: KVConnectorBase,
    scheduler_output: SchedulerOutput,
    execute: Callable[[SchedulerOutput], ModelRunnerOutput],
) -> ModelRunnerOutput:
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata or KVConnectorMetadata())
    try:
        connector.start_load_kv()
        output = execute(scheduler_output)
        connector.wait_for_save()
        wait_s = IDLE_POLL_S if scheduler_output.is_empty else 0.0
        output.finished_sending, output.finished_recving = connector.get_finished(wait_s)
    finally:
        connector.clear_connector_metadata()
    return output
