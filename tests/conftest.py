"""Shared fixtures (the default model's files, the workloads) and the test tiers.

``make test-fast`` runs ``-m "not slow"``: the tests that start no engine,
server or stack process and load no real model, for the edit-test loop.
A test is ``slow`` when ``SLOW`` (kept here, one list, so every test's tier
is visible at a glance) names its module or the test itself, or when it
carries ``@pytest.mark.slow``. ``make test`` runs both tiers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services import model_files
from services.stack import Stack
from tests.utils import REPO_ROOT, gguf_parsed_once

# Modules (or single tests, ``path::name``) that start processes (engine cores,
# servers, stacks, worker processes) or load the real model: seconds to minutes each.
SLOW = frozenset(
    {
        "tests/api/test_dp_client.py",
        "tests/api/test_dp_client_links.py",
        "tests/api/test_dp_client_rejoin.py",
        "tests/api/test_prefix_routing.py",
        "tests/api/test_structured_api.py",
        "tests/api/test_template_sandbox.py::test_sigterm_stops_a_server_rendering_an_endless_template",
        "tests/bench/test_bench_cli.py",
        "tests/bench/test_bench_serve.py",
        "tests/bench/test_bench_spec.py",
        "tests/bench/test_bench_structured.py",
        "tests/bench/test_compare.py",
        "tests/bench/test_executor_overhead.py",
        "tests/bench/test_hf_baseline.py",
        "tests/bench/test_latency_and_datasets.py::test_end_to_end_latency",
        "tests/bench/test_make_model.py::test_weft_greedy_matches_transformers",
        "tests/bench/test_latency_and_datasets.py::test_end_to_end_throughput_on_random_prompts",
        "tests/bench/test_step_phases.py::test_speculation_times_the_proposer",
        "tests/engine_core/test_hung_step.py",
        "tests/engine_core/test_kv_events_publisher.py",
        "tests/engine_core/test_proc.py",
        "tests/engine_core/test_proc_hostile.py",
        "tests/engine_core/test_structured_output_xgrammar.py",
        "tests/kernels/test_e2e_triton.py",
        "tests/kernels/test_triton_architectures.py",
        "tests/kv_transfer/test_offline.py",
        "tests/kv_transfer/test_offline_forged.py",
        "tests/kv_transfer/test_pd_e2e.py",
        "tests/kv_transfer/test_proxy_front.py",
        "tests/kv_transfer/test_pd_readme.py::test_weft_pd_up_transfers_the_prompt_and_answers_as_one_server_would",
        "tests/test_api_params_e2e.py",
        "tests/test_async_scheduling_llm.py",
        "tests/test_gemma3.py",
        "tests/test_embeddings_e2e.py",
        "tests/test_embeddings_oracle.py",
        "tests/test_generation_config.py",
        "tests/test_hostile_http.py",
        "tests/test_llm.py",
        "tests/test_int8_dense_copy_llm.py",
        "tests/test_management_e2e.py",
        "tests/test_queueing_e2e.py",
        "tests/test_memory_serve.py",
        "tests/test_operator_serve.py",
        "tests/test_tls_serve.py",
        "tests/test_reliability.py",
        "tests/test_responses_serve.py",
        "tests/test_serving.py",
        "tests/test_sliding_window_engine.py",
        "tests/test_spec_decode.py",
        "tests/test_batch_invariance.py",
        "tests/test_structured_outputs.py",
        "tests/test_tensor_parallel.py",
        "tests/test_tool_calling_serve.py",
        "tests/worker/test_llama_oracle.py",
        "tests/worker/test_model_runner.py",
        "tests/worker/test_multiproc_executor.py",
        "tests/worker/test_parallel_linear.py::test_sharded_layers_match_unsharded_over_gloo",
        "tests/worker/test_quantized_model.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.relative_to(REPO_ROOT).as_posix()
        if module in SLOW or f"{module}::{item.originalname}" in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def default_model() -> model_files.ModelFiles:
    return model_files.resolve(None)


@pytest.fixture(scope="session")
def hf_default_model():
    """Transformers' model of the default GGUF, dequantized to fp32: the oracle.

    Loaded once per session (transformers reads the GGUF in Python: seconds
    to tens of seconds on this machine). Tests only run it, never change it.
    """
    from services.bench.hf_baseline import load_hf_model

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
