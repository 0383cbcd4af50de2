"""The engine-core process's command line: what a launcher writes, the process reads."""

from __future__ import annotations

import sys

import pytest

from services.engine_core.proc_args import DEFAULT_SHUTDOWN_TIMEOUT_S, PROC_MODULE, EngineCoreArgs


def test_every_field_survives_to_argv_then_parse() -> None:
    args = EngineCoreArgs(
        rank=2,
        handshake_address="tcp://10.0.0.1:29550",
        local=True,
        headless=True,
        num_threads=3,
        tensor_parallel_size=2,
        curve_keys="/keys",
        shutdown_timeout_s=7.5,
        kv_transfer_config='{"kv_connector": "ZmqConnector"}',
        engines_on_node=2,
        available_memory=16 << 30,
    )
    argv = args.to_argv()
    assert argv[:3] == [sys.executable, "-m", PROC_MODULE]
    assert EngineCoreArgs.parse(argv[3:]) == args


def test_defaults_are_left_out_or_written_as_the_process_reads_them() -> None:
    args = EngineCoreArgs(rank=0, handshake_address="ipc:///tmp/h")
    argv = args.to_argv()[3:]
    assert "--local" not in argv and "--num-threads" not in argv and "--zmq-curve-keys" not in argv
    parsed = EngineCoreArgs.parse(argv)
    assert parsed == args and parsed.shutdown_timeout_s == DEFAULT_SHUTDOWN_TIMEOUT_S


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--handshake-address", "ipc:///h"], "--rank"),
        (["--rank", "-1", "--handshake-address", "ipc:///h"], "--rank must be non-negative"),
        (
            ["--rank", "0", "--handshake-address", "ipc:///h", "--shutdown-timeout", "-2"],
            "--shutdown-timeout",
        ),
        (["--rank", "zero", "--handshake-address", "ipc:///h"], "invalid int value"),
    ],
)
def test_bad_command_lines_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        EngineCoreArgs.parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_headless_engines_size_their_caches_from_their_own_node(monkeypatch) -> None:
    """engine-core --headless measures its node once and hands every engine it starts the
    same number, with how many engines share it (the API's config holds the API node's)."""
    from services.engine_core import cli

    args = cli.parse_args(
        [
            "--headless",
            "--data-parallel-size",
            "4",
            "--dp-start-rank",
            "2",
            "--data-parallel-address",
            "10.0.0.1",
            "--data-parallel-rpc-port",
            "29550",
        ]
    )
    args.available_memory = 12 << 30  # what main() measured before starting them
    engine = cli.engine_args(args, 3, "tcp://10.0.0.1:29550")
    assert (engine.engines_on_node, engine.available_memory) == (2, 12 << 30)
