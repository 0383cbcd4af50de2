"""Remote engine cores reach the API on fixed ports, so a firewall can let them through."""

from __future__ import annotations

import pytest

from services.api.dp_client import DPLBEngineClient
from services.api.server import build_parser, data_ports
from services.config.engine_args import EngineArgs
from services.ports import free_port


def ports_of(*argv: str) -> tuple[int, int]:
    return data_ports(build_parser().parse_args(list(argv)))


def test_the_data_ports_follow_the_rpc_port_unless_given() -> None:
    assert ports_of() == (29551, 29552)
    assert ports_of("--data-parallel-rpc-port", "40000") == (40001, 40002)
    assert ports_of("--data-parallel-input-port", "5001", "--data-parallel-output-port", "5002") == (
        5001,
        5002,
    )
    assert ports_of("--data-parallel-rpc-port", "0") == (0, 0)  # any free port, as the handshake's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-input-port", "70000"], "--data-parallel-input-port must be in"),
        (["--data-parallel-rpc-port", "65535"], "--data-parallel-input-port must be in"),
        (["--data-parallel-output-port", "29551"], "must differ"),
        (["--data-parallel-input-port", "29550"], "must differ"),
    ],
)
def test_bad_data_ports_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ports_of(*argv)


async def test_the_client_binds_the_data_sockets_on_the_given_ports() -> None:
    config = EngineArgs(data_parallel_size=2).create_engine_config()
    handshake, input_port, output_port = free_port(), free_port(), free_port()
    client = DPLBEngineClient(
        config, f"tcp://127.0.0.1:{handshake}", num_ranks=2, data_ports=(input_port, output_port)
    )
    await client.start()
    try:
        # What the handshake reply tells every engine to connect to.
        assert client.input_address == f"tcp://127.0.0.1:{input_port}"
        assert client.output_address == f"tcp://127.0.0.1:{output_port}"
    finally:
        await client.shutdown()
