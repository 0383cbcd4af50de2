"""Shared fixtures (the default model's files, the workloads) and the test tiers.

``make test-fast`` runs ``-m "not slow"``: the tests that start no engine,
server or stack process and load no real model, for the edit-test loop.
A module that starts one says so itself (``pytestmark = pytest.mark.slow``,
or ``@pytest.mark.slow`` on the test); tests/repo/test_test_hygiene.py fails
when one that starts them is not marked. ``make test`` runs both tiers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.stack import Stack
from services import model_files
from tests.utils import REPO_ROOT, gguf_parsed_once

# Which xdist worker runs which tests, in what order, on how many torch threads.
pytest_plugins = ["tests.scheduling"]


@pytest.fixture(scope="session")
def default_model() -> model_files.ModelFiles:
    return model_files.resolve(None)


@pytest.fixture(scope="session")
def hf_default_model():
    """Transformers' model of the default GGUF, dequantized to fp32: the oracle.

    Loaded once per session (transformers reads the GGUF in Python: seconds
    to tens of seconds on this machine). Tests only run it, never change it.
    """
    from benchmarks.bench.hf_baseline import load_hf_model

    with gguf_parsed_once():
        return load_hf_model(None, "float32")


@pytest.fixture(scope="session")
def workloads_dir() -> Path:
    return REPO_ROOT / "benchmarks" / "workloads"


@pytest.fixture(scope="session")
def default_server(tmp_path_factory) -> Iterator[Stack]:
    """One ``weft serve`` on the default model (fp32, one engine core, 1024-token
    sequences, 512-token steps, auto tool choice with the hermes parser), shared by
    the modules that only send it requests: tool calling, structured outputs over
    HTTP, request parameters. A request without tools never meets the tool parser.
    Tests that pause, reset, damage or stop a server start their own.
    """
    stack = Stack(
        [
            "--model",
            str(model_files.resolve(None).weights),
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--max-num-batched-tokens",
            "512",
            "--num-threads",
            "1",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ],
        tmp_path_factory.mktemp("default-server"),
        startup_timeout_s=240,
    )
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.kill()
