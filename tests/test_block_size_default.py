"""The KV block size when none is asked for: 128 on CPU (vLLM's CPU default), 16 on CUDA."""

from __future__ import annotations

import argparse

import pytest

from services.config.cli_args import add_engine_args, engine_args_from
from services.config.engine_args import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE, EngineArgs


def block_size_of(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from(parser.parse_args(list(argv))).create_engine_config().cache.block_size


def test_unset_block_size_follows_the_device():
    assert (CPU_BLOCK_SIZE, GPU_BLOCK_SIZE) == (128, 16)
    assert block_size_of("--device", "cpu") == 128
    assert EngineArgs(device="cuda").create_engine_config().cache.block_size == 16


def test_an_asked_block_size_is_kept_on_either_device():
    assert block_size_of("--device", "cpu", "--block-size", "16") == 16
    assert EngineArgs(device="cuda", block_size=32).create_engine_config().cache.block_size == 32


@pytest.mark.parametrize("value", [0, -16])
def test_a_block_size_below_one_is_refused(value):
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        EngineArgs(device="cpu", block_size=value).create_engine_config()
