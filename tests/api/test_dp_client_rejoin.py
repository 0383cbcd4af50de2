"""A headless engine core that crashes and is started again rejoins the API.

A real ``engine-core --headless`` node (a tiny random Llama) on a CURVE
link: killed, its in-flight request fails with a clear error once it goes
silent; started again by the operator, it shakes hands anew and serves.
(Local ranks restarted by the API itself are tested on the whole stack in
tests/test_reliability.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from protocol import FinishReason
from protocol.curve import SERVER, generate_keys, load_keys
from protocol.zmq_sockets import tcp_address
from services.api.dp_client import DPLBEngineClient
from services.api.engine_client import EngineDeadError
from tests.api.dp_requests import collect, make_request
from tests.polling import wait_until
from tests.tiny_model import build_tiny_llama, tiny_engine_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

START_S = 90.0  # engine start-up on two busy cores


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    return tiny_engine_config(build_tiny_llama(tmp_path_factory.mktemp("tiny")), 64)


@pytest.fixture
def operator_processes():
    processes: list[subprocess.Popen] = []
    yield processes
    for proc in processes:  # each in its own session: kill its engine too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


async def test_a_headless_rank_restarted_by_the_operator_rejoins_over_curve(
    tiny_config, tmp_path, operator_processes
):
    keys = tmp_path / "keys"
    generate_keys(keys)
    client = DPLBEngineClient(
        tiny_config,
        tcp_address("127.0.0.1", 0, bind=True),
        1,
        silence_timeout_s=1.5,
        curve=load_keys(keys, SERVER),
    )

    def start_node() -> None:
        port = client.handshake_address.rsplit(":", 1)[1]
        operator_processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.engine_core.cli",
                    "--headless",
                    "--data-parallel-size",
                    "1",
                    "--data-parallel-address",
                    "127.0.0.1",
                    "--data-parallel-rpc-port",
                    port,
                    "--num-threads",
                    "1",
                    "--zmq-curve-keys",
                    str(keys),
                ],
                start_new_session=True,
            )
        )

    try:
        await client.start()
        start_node()
        await wait_until(lambda: client.ready, START_S, "the headless rank")
        in_flight = client.generate(make_request("remote", max_tokens=400, first_token=300))
        await anext(in_flight)
        os.killpg(operator_processes[0].pid, signal.SIGKILL)  # the node's processes crash
        with pytest.raises(EngineDeadError, match="sent nothing"):
            async for _ in in_flight:
                pass
        start_node()  # the operator starts it again: same rank, new process
        await wait_until(lambda: client.ready, START_S, "the rank to rejoin")
        tokens, last = await collect(client, make_request("rejoined", max_tokens=6, first_token=300))
        assert len(tokens) == 6 and last.finish_reason == FinishReason.LENGTH
    finally:
        await client.shutdown()
