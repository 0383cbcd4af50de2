"""``--quantization``: gguf (kept packed) by default for GGUF files on CPU, none to dequantize."""

from __future__ import annotations

import argparse

import pytest

from services.config.cli_args import add_engine_args, engine_args_from
from services.config.engine_args import EngineArgs, resolve_quantization


def quantization_of(**kwargs) -> str:
    return EngineArgs(**kwargs).create_engine_config().model.quantization


def test_gguf_files_stay_quantized_by_default_on_cpu():
    assert quantization_of(device="cpu") == "gguf"
    assert quantization_of(device="cpu", quantization="none") == "none"
    assert quantization_of(device="cpu", load_format="dummy") == "none"  # nothing is read to keep packed


def test_the_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--quantization", "none", "--device", "cpu"]))
    assert args.create_engine_config().model.quantization == "none"


def test_impossible_choices_are_refused_clearly():
    with pytest.raises(ValueError, match="quantization must be 'gguf' or 'none'"):
        resolve_quantization("awq", True, "cpu", "auto")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("gguf", True, "cuda", "auto")
    with pytest.raises(ValueError, match="needs a GGUF model file"):
        resolve_quantization("gguf", False, "cpu", "auto")
    with pytest.raises(ValueError, match="needs a GGUF model file"):
        resolve_quantization("gguf", True, "cpu", "dummy")
    assert resolve_quantization(None, True, "cuda", "auto") == "none"
    assert resolve_quantization(None, False, "cpu", "auto") == "none"
