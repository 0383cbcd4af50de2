"""``--config FILE.yaml`` and the WEFT_* flag overrides, on the real ``weft serve`` parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import config_file, env
from services.api.server import build_parser as serve_parser
from services.engine_core.cli import parse_args as engine_core_args


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "weft.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture(autouse=True)
def no_weft_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in env.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)


def test_any_flag_comes_from_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "port: 9000\nmax_model_len: 512\nenable-prefix-caching: false\n"
        "api-key: [a, b]\nspeculative-config: {method: ngram, num_speculative_tokens: 3}\n",
    )
    args = config_file.parse_args(serve_parser(), ["--config", path])
    assert args.port == 9000 and args.max_model_len == 512 and args.enable_prefix_caching is False
    assert args.api_key == ["a", "b"]
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}


def test_the_command_line_wins_over_the_environment_which_wins_over_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "port: 9000\nhost: 10.0.0.1\napi-key: [from-file]\n")
    monkeypatch.setenv("WEFT_PORT", "9100")
    monkeypatch.setenv("WEFT_HOST", "10.0.0.2")
    args = config_file.parse_args(serve_parser(), ["--config", path, "--port", "9200", "--api-key", "cli"])
    assert (args.port, args.host, args.api_key) == (9200, "10.0.0.2", ["cli"])


def test_weft_config_names_the_file_when_the_command_line_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEFT_CONFIG", write(tmp_path, "max-num-seqs: 7\n"))
    assert config_file.parse_args(serve_parser(), []).max_num_seqs == 7


def test_no_argv_means_the_process_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "sys.argv",
        [
            "engine-core",
            "--headless",
            "--data-parallel-size",
            "1",
            "--data-parallel-address",
            "h",
            "--data-parallel-rpc-port",
            "1",
        ],
    )
    args = engine_core_args(None)
    assert args.headless and args.data_parallel_size == 1 and args.data_parallel_address == "h"


def test_engine_core_takes_a_config_file_too(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "headless: true\ndata-parallel-size: 2\ndata-parallel-address: api\ndata-parallel-rpc-port: 29550\n",
    )
    args = engine_core_args(["--config", path, "--dp-start-rank", "1"])
    assert (args.data_parallel_size, args.data_parallel_address, args.start_rank) == (2, "api", 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no-such-flag: 1\n", "'no-such-flag' is not a flag of weft serve"),
        ("port: eight\n", "--port: invalid int value: 'eight'"),
        ("enable-prefix-caching: maybe\n", "enable-prefix-caching takes true or false"),
        ("- port\n- 8000\n", "must be a mapping of flag names to values"),
        ("port: [8000\n", "is not valid YAML"),
        ("config: other.yaml\n", "'config' is not a flag"),
    ],
)
def test_a_bad_file_is_a_usage_error_naming_the_problem(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        config_file.parse_args(serve_parser(), ["--config", write(tmp_path, text)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_or_huge_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_file.parse_args(serve_parser(), ["--config", str(tmp_path / "nope.yaml")])
    assert "No such file" in capsys.readouterr().err
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * config_file.MAX_CONFIG_BYTES)
    with pytest.raises(SystemExit):
        config_file.parse_args(serve_parser(), ["--config", str(huge)])
    assert "larger than" in capsys.readouterr().err


def test_help_lists_the_config_option_and_the_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_file.parse_args(serve_parser(), ["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--config FILE.yaml" in out and "WEFT_PORT (--port)" in out
