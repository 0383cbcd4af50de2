"""`weft serve`'s hardening flags: keys kept out of `ps`, limits handed to the app and uvicorn."""

from __future__ import annotations

import msgspec
import pytest

from services.api.limits import ServingLimits
from services.api.server import api_keys, build_parser, serving_limits, uvicorn_options


def parse(*argv: str):
    return build_parser().parse_args(["--model", "m", *argv])


def test_keys_come_from_a_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\nfirst\n\n  second  \n")
    assert api_keys(parse("--api-key-file", str(path))) == ["first", "second"]
    assert api_keys(parse("--api-key", "cli", "--api-key-file", str(path))) == ["cli", "first", "second"]


def test_an_empty_key_file_is_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        api_keys(parse("--api-key-file", str(path)))


def test_keys_come_from_the_environment_only_without_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("WEFT_API_KEY", "env-1,env-2")
    assert api_keys(parse()) == ["env-1", "env-2"]
    assert api_keys(parse("--api-key", "cli")) == ["cli"]
    monkeypatch.delenv("WEFT_API_KEY")
    assert api_keys(parse()) == []


def test_the_limits_reach_the_app_and_uvicorn():
    args = parse(
        "--max-prompts",
        "7",
        "--max-prompt-chars",
        "99",
        "--max-stop",
        "3",
        "--max-stop-bytes",
        "40",
        "--max-stop-token-ids",
        "5",
        "--body-timeout",
        "2.5",
        "--max-connections",
        "11",
        "--keep-alive-timeout",
        "1.5",
        "--no-api-key-protects-tokenize",
        "--max-messages",
        "13",
    )
    limits = serving_limits(args)
    assert (
        limits.max_prompts,
        limits.max_prompt_chars,
        limits.max_stop,
        limits.max_stop_bytes,
        limits.max_stop_token_ids,
        limits.body_timeout_s,
        limits.max_messages,
    ) == (7, 99, 3, 40, 5, 2.5, 13)
    options = uvicorn_options(args)
    assert options["limit_concurrency"] == 11 and options["timeout_keep_alive"] == 1.5
    assert options["http"].header_timeout_s == 2.5
    assert args.api_key_protects_tokenize is False


def test_the_defaults_bound_everything():
    args = parse()
    assert serving_limits(args) == ServingLimits()
    assert uvicorn_options(args)["limit_concurrency"] > 0
    assert args.api_key_protects_tokenize is True


@pytest.mark.parametrize("argv", [("--max-stop", "0"), ("--body-timeout", "0"), ("--max-prompts", "-1")])
def test_nonsense_limits_are_refused(argv):
    with pytest.raises(ValueError):
        serving_limits(parse(*argv))


def test_waiting_requests_default_to_a_fixed_bound_lowered_only_where_memory_is_short(monkeypatch):
    from services.api import limits as limits_module
    from services.api import server
    from services.api.limits import DEFAULT_MAX_WAITING_REQUESTS
    from tests.api.fake_engine_client import engine_config

    config = engine_config(max_model_len=8192)
    one = ServingLimits().waiting_request_bytes(8192)
    # The body, the prompt text at 4 bytes a character, 128 bytes a token: what --help says.
    assert one == 4 * 2**20 + 4 * 2**20 + 128 * 8191
    assert ServingLimits(max_prompt_tokens=100, max_prompt_chars=10).waiting_request_bytes(8192) == (
        4 * 2**20 + 40 + 12800
    )
    assert ServingLimits().waiting_per_rank() == DEFAULT_MAX_WAITING_REQUESTS == 1024

    plenty, short = 2 * 2048 * one, 2 * 100 * one  # twice: the requests get half the memory
    monkeypatch.setattr(server, "available_memory_bytes", lambda: plenty)
    assert serving_limits(parse(), config).max_waiting_requests == 1024
    monkeypatch.setattr(server, "available_memory_bytes", lambda: short)
    assert serving_limits(parse(), config).max_waiting_requests == 100
    two_ranks = parse("--data-parallel-size", "2")
    config2 = msgspec.structs.replace(
        config, parallel=msgspec.structs.replace(config.parallel, data_parallel_size=2)
    )
    assert serving_limits(two_ranks, config2).max_waiting_requests == 50  # every rank's queue together
    # Given on the command line, it is taken as is; a smaller prompt cap makes room for more.
    assert serving_limits(parse("--max-waiting-requests", "3000"), config).max_waiting_requests == 3000
    smaller = parse("--max-prompt-chars", "1000", "--max-request-body-bytes", "100000")
    each = 100000 + 4000 + 128 * 8191
    assert serving_limits(smaller, config).max_waiting_requests == short // 2 // each > 100
    assert limits_module.available_memory_bytes() > 0


def test_the_step_timeout_defaults_to_minutes_and_zero_is_refused(capsys):
    from services.api.server import main

    assert parse().step_timeout == 300.0
    assert main(["--step-timeout", "0"]) == 2
    assert "--step-timeout must be positive" in capsys.readouterr().err
