"""Worker KV sizing and the in-process executor, on a tiny random model."""

from __future__ import annotations

import msgspec
import pytest

from protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from services.worker.executor import UniProcExecutor
from services.worker.worker import Worker

MiB = 1 << 20


def tiny_config(make_engine_config, folder, **kwargs):
    return make_engine_config(
        str(folder), str(folder), max_model_len=256, max_num_batched_tokens=256, **kwargs
    )


def test_kv_cache_memory_is_the_caches_bytes_alone(make_engine_config, tiny_llama_dir):
    worker = Worker(tiny_config(make_engine_config, tiny_llama_dir, kv_cache_memory=256 * MiB))
    worker.init_device()
    num_blocks = worker.determine_num_blocks()
    runner = worker.model_runner
    assert (
        runner.kv_block_bytes == 2 * 16 * 2 * 16 * 4 * 2
    )  # K/V x block x kv heads x head dim x fp32 x layers
    assert num_blocks == 256 * MiB // runner.kv_block_bytes  # weights and activations come on top


def test_the_cpu_default_is_the_share_of_available_memory_left(make_engine_config, tiny_llama_dir):
    config = tiny_config(make_engine_config, tiny_llama_dir)
    available = 64 * MiB + 2 * MiB * 3 // 2  # two engines; the tiny model's plan fits in what is left
    node = msgspec.structs.replace(
        config.cache, available_memory=4 * available, cpu_memory_utilization=0.5, engines_on_node=2
    )
    worker = Worker(msgspec.structs.replace(config, cache=node))
    worker.load_model()
    share = available  # 4 x available x 0.5 / 2
    kv, source = worker.kv_budget(activation_peak=MiB)
    assert kv == share - worker.runtime_bytes - worker.model_runner.weights_bytes - MiB
    assert "/ 2 engine process(es)" in source


def test_the_cpu_default_never_allocates_more_than_the_sequences_can_use(make_engine_config, tiny_llama_dir):
    config = tiny_config(make_engine_config, tiny_llama_dir)
    lots = msgspec.structs.replace(config.cache, available_memory=1 << 40)  # a terabyte
    num_blocks = Worker(msgspec.structs.replace(config, cache=lots)).determine_num_blocks()
    assert num_blocks == config.scheduler.max_num_seqs * (256 // 16) + 1  # 256-token sequences, + null


def test_too_small_a_cache_says_what_to_change(make_engine_config, tiny_llama_dir):
    worker = Worker(tiny_config(make_engine_config, tiny_llama_dir, kv_cache_memory=10 * 8192))  # 10 blocks
    with pytest.raises(
        ValueError, match=r"--max-model-len \(256 tokens\) needs 17 blocks.*but 10 fit.*--kv-cache-memory"
    ):
        worker.determine_num_blocks()


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
