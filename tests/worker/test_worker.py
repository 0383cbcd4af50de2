"""Worker KV sizing and the in-process executor, on a tiny random model."""

from __future__ import annotations

import pytest

from protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from services.worker.executor import UniProcExecutor
from services.worker.worker import Worker, budget_advice, kv_blocks_from_memory

MiB = 1 << 20


def tiny_config(make_engine_config, folder, **kwargs):
    return make_engine_config(
        str(folder), str(folder), max_model_len=256, max_num_batched_tokens=256, **kwargs
    )


def test_blocks_are_the_budget_left_after_weights_and_activations(make_engine_config, tiny_llama_dir):
    worker = Worker(tiny_config(make_engine_config, tiny_llama_dir, kv_cache_memory=256 * MiB))
    worker.init_device()
    num_blocks = worker.determine_num_blocks()
    runner = worker.model_runner
    assert (
        runner.kv_block_bytes == 2 * 16 * 2 * 16 * 4 * 2
    )  # K/V x block x kv heads x head dim x fp32 x layers
    upper = (256 * MiB - runner.weights_bytes) // runner.kv_block_bytes
    # The profiled peak is a resident-set rise, so other tests in this process
    # move it (freed memory reused from earlier tests can make it 0); allow up
    # to 128 MiB (the gather workspace alone may take 64).
    assert upper - (128 * MiB) // runner.kv_block_bytes < num_blocks <= upper


def test_blocks_formula():
    assert kv_blocks_from_memory(budget=1000, weights=100, activation_peak=100, block_bytes=100) == 8
    assert kv_blocks_from_memory(budget=100, weights=100, activation_peak=100, block_bytes=100) == 0


def test_too_small_a_budget_says_what_to_change(make_engine_config, tiny_llama_dir):
    worker = Worker(tiny_config(make_engine_config, tiny_llama_dir, kv_cache_memory=MiB // 4))
    with pytest.raises(ValueError, match=r"max_model_len.*Raise --kv-cache-memory \(now 262144 bytes\)"):
        worker.determine_num_blocks()


def test_the_cpu_default_budget_error_names_the_flag_and_a_size(make_engine_config, tiny_llama_dir):
    config = tiny_config(make_engine_config, tiny_llama_dir)
    assert config.cache.kv_cache_memory is None and config.device.device == "cpu"
    advice = budget_advice(config, needed_bytes=(2 << 30) + 1)
    assert "default budget is 2 GiB for the weights" in advice
    assert f"--kv-cache-memory (bytes; at least 3 GiB = {3 << 30} here)" in advice


def test_override_wins_but_needs_two_blocks(make_engine_config, tiny_llama_dir):
    assert Worker(tiny_config(make_engine_config, tiny_llama_dir, num_blocks=5)).determine_num_blocks() == 5
    with pytest.raises(ValueError, match="at least 2"):
        Worker(tiny_config(make_engine_config, tiny_llama_dir, num_blocks=1)).determine_num_blocks()


def test_uniproc_executor_runs_steps(make_engine_config, tiny_llama_dir):
    executor = UniProcExecutor(tiny_config(make_engine_config, tiny_llama_dir, num_blocks=8))
    num_blocks = executor.determine_num_blocks()
    executor.initialize_cache(num_blocks)
    params = SamplingParams(temperature=0.0)
    out = executor.execute_model(
        SchedulerOutput(
            [NewRequestData("r", [3, 1, 4, 1, 5], params, [1], 0)], CachedRequestData(), {"r": 5}, 5
        )
    )
    assert out.req_ids == ["r"] and len(out.sampled_token_ids[0]) == 1
    out = executor.execute_model(SchedulerOutput([], CachedRequestData(["r"], [[]], [5]), {"r": 1}, 1))
    assert len(out.sampled_token_ids[0]) == 1
    assert executor.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, ["r"])).req_ids == []
    executor.shutdown()
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0))
