"""``speculative_config`` from ``LLM(...)`` dicts and ``--speculative-config`` JSON."""

from __future__ import annotations

import argparse

import pytest

from protocol import SpeculativeConfig
from services.config.cli_args import add_engine_args, engine_args_from
from services.config.engine_args import EngineArgs
from services.config.speculative_args import resolve_speculative_config


def test_a_dict_becomes_the_config() -> None:
    config = resolve_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    )
    assert config == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5)


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, (5, 5)),  # neither bound: vLLM's 5 and 5
        ({"prompt_lookup_max": 3}, (3, 3)),  # one bound: the other copies it
        ({"prompt_lookup_min": 2}, (2, 2)),
    ],
)
def test_missing_lookup_bounds_are_filled_as_vllm_does(given: dict, expected: tuple[int, int]) -> None:
    config = resolve_speculative_config({"num_speculative_tokens": 3, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected
    assert config.method == "ngram"


def test_json_text_and_off_values() -> None:
    config = resolve_speculative_config(
        '{"num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (2, 1, 4)
    assert resolve_speculative_config(None) is None
    assert resolve_speculative_config("") is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 4, "method": "eagle"}, "method"),
        ({"num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 4, "draft_model": "x"}, "draft_model"),
    ],
)
def test_bad_configs_are_refused_with_a_reason(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_speculative_config(value)


def test_the_command_line_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"num_speculative_tokens": 4, "prompt_lookup_min": 2}']
    )
    config = engine_args_from(args).create_engine_config()
    assert config.speculative == SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=2
    )
    assert EngineArgs().create_engine_config().speculative is None
