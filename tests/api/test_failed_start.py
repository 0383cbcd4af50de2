"""A local engine core that exits before it was ever ready stops the API instead of being restarted."""

from __future__ import annotations

import subprocess
import sys

from protocol import EngineConfig, ModelConfig
from protocol.zmq_sockets import ipc_address
from services.api.dp_client import DPLBEngineClient
from tests.polling import wait_until

CONFIG = EngineConfig(
    model=ModelConfig(model="m", tokenizer="t", served_model_name="m", dtype="float32", max_model_len=64)
)


async def test_an_engine_that_never_served_is_a_start_failure_not_restarted():
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    client = DPLBEngineClient(CONFIG, ipc_address("handshake"), 1, [failing], restart_local=True)
    await client.start()
    try:
        assert client.start_failure is None
        failure = await wait_until(lambda: client.start_failure, 30, "the start failure")
        assert failure == "engine core rank 0 failed to start: its process exited with code 3"
        assert client.local.restart_due() == [] and client.local.num_restarts[0] == 0
        assert client.max_model_len is None  # no engine reported a context
    finally:
        await client.shutdown()
