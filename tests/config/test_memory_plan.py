"""The CPU KV budget's arithmetic: available memory, the split among engines, the context that fits."""

from __future__ import annotations

import pytest

from protocol import CacheConfig, EngineConfig, ModelConfig
from services.config.memory_plan import (
    MIN_FITTED_MAX_MODEL_LEN,
    blocks_per_sequence,
    cgroup_headroom,
    engine_share,
    fit_max_model_len,
    mem_available,
    node_available_memory,
    useful_blocks,
    with_node_memory,
)

GiB = 1 << 30
MEMINFO = """MemTotal:       24683520 kB
MemFree:        23240000 kB
MemAvailable:   16777216 kB
Buffers:           10240 kB
"""


def test_mem_available_reads_its_line_in_bytes():
    assert mem_available(MEMINFO) == 16 * GiB
    with pytest.raises(ValueError, match="no MemAvailable"):
        mem_available("MemTotal: 1 kB\n")


def test_a_cgroup_limit_is_the_limit_minus_the_usage():
    assert cgroup_headroom("4294967296\n", "1073741824\n") == 3 * GiB
    assert cgroup_headroom("max\n", "1073741824\n") is None  # v2: no limit
    assert cgroup_headroom("9223372036854771712\n", "5\n") is None  # v1: no limit
    assert cgroup_headroom(str(GiB), str(2 * GiB)) == 0  # over its limit: nothing left


def _fake_node(root, cgroup_lines: str, files: dict[str, str]):
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(MEMINFO)
    (root / "proc/self/cgroup").write_text(cgroup_lines)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_a_container_limit_bounds_the_available_memory_v2(tmp_path):
    _fake_node(
        tmp_path,
        "0::/docker/abc\n",
        {
            "sys/fs/cgroup/docker/abc/memory.max": str(8 * GiB),
            "sys/fs/cgroup/docker/abc/memory.current": str(2 * GiB),
            "sys/fs/cgroup/memory.max": "max",  # the root: no limit
        },
    )
    assert node_available_memory(tmp_path) == 6 * GiB


def test_a_parent_cgroups_limit_counts_too_v1(tmp_path):
    _fake_node(
        tmp_path,
        "4:memory:/slice/job\n1:cpu:/\n",
        {
            "sys/fs/cgroup/memory/slice/job/memory.limit_in_bytes": "9223372036854771712",
            "sys/fs/cgroup/memory/slice/job/memory.usage_in_bytes": str(GiB),
            "sys/fs/cgroup/memory/slice/memory.limit_in_bytes": str(4 * GiB),
            "sys/fs/cgroup/memory/slice/memory.usage_in_bytes": str(3 * GiB),
        },
    )
    assert node_available_memory(tmp_path) == GiB


def test_without_a_limit_the_available_memory_is_memavailable(tmp_path):
    _fake_node(tmp_path, "0::/\n", {"sys/fs/cgroup/memory.max": "max", "sys/fs/cgroup/memory.current": "1"})
    assert node_available_memory(tmp_path) == 16 * GiB


def test_engines_on_one_node_split_its_share_evenly():
    assert engine_share(16 * GiB, 0.9, 1) == int(16 * GiB * 0.9)
    assert engine_share(16 * GiB, 0.9, 4) == int(16 * GiB * 0.9) // 4
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="cpu_memory_utilization must be in"):
            engine_share(GiB, bad, 1)


def test_a_sequence_holds_every_block_of_a_full_group_and_a_windows_worth_of_the_others():
    assert blocks_per_sequence(1000, 128, [None], 1024) == 8
    # Gemma 3: one full group and five 512-token window groups; steps of 1024 tokens.
    gemma = [None] + [512] * 5
    window_blocks = -(-(511 + 1024) // 128) + 1
    assert blocks_per_sequence(32768, 128, gemma, 1024) == 256 + 5 * window_blocks
    assert blocks_per_sequence(256, 128, gemma, 1024) == 2 * 6  # short: all groups hold all of it


def test_a_context_that_fits_is_kept():
    kwargs = dict(block_size=128, group_windows=[None], step_tokens=1024)
    assert fit_max_model_len(8192, auto=True, num_blocks=65, **kwargs) == 8192
    assert fit_max_model_len(8192, auto=False, num_blocks=65, **kwargs) == 8192


def test_the_models_context_is_lowered_to_the_blocks_that_fit():
    kwargs = dict(block_size=128, group_windows=[None], step_tokens=1024)
    assert fit_max_model_len(32768, auto=True, num_blocks=75, **kwargs) == 74 * 128
    gemma = dict(block_size=128, group_windows=[None] + [512] * 5, step_tokens=1024)
    fitted = fit_max_model_len(32768, auto=True, num_blocks=200, **gemma)
    assert fitted % 128 == 0 and blocks_per_sequence(fitted, **gemma) + 1 <= 200
    assert blocks_per_sequence(fitted + 128, **gemma) + 1 > 200


def test_an_explicit_context_that_does_not_fit_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as error:
        fit_max_model_len(
            8192,
            auto=False,
            num_blocks=10,
            block_size=128,
            group_windows=[None],
            step_tokens=1024,
            block_bytes=GiB,
        )
    message = str(error.value)
    assert "--max-model-len (8192 tokens) needs 65 blocks of 128 tokens (65.00 GiB)" in message
    assert "but 10 fit (10.00 GiB), which hold 1152 tokens" in message


def test_the_models_context_is_not_lowered_below_a_useful_length():
    blocks = MIN_FITTED_MAX_MODEL_LEN // 128  # one short of the floor (the null block)
    with pytest.raises(ValueError, match=f"no fewer than {MIN_FITTED_MAX_MODEL_LEN}"):
        fit_max_model_len(
            32768, auto=True, num_blocks=blocks, block_size=128, group_windows=[None], step_tokens=1024
        )
    with pytest.raises(ValueError, match="which hold 0 tokens"):
        fit_max_model_len(
            32768, auto=True, num_blocks=0, block_size=128, group_windows=[None], step_tokens=1024
        )


def test_no_more_blocks_than_the_running_sequences_can_use():
    assert useful_blocks(4, 1024, 128, [None], 1024) == 4 * 8 + 1


def test_the_nodes_memory_goes_to_its_engines_unless_the_budget_is_given():
    model = ModelConfig(model="m", tokenizer="t", served_model_name="m", dtype="float32", max_model_len=64)
    config = EngineConfig(model=model, cache=CacheConfig(available_memory=8 * GiB))
    node = with_node_memory(config, 3, 5 * GiB)
    assert (node.cache.engines_on_node, node.cache.available_memory) == (3, 5 * GiB)
    given = EngineConfig(model=model, cache=CacheConfig(kv_cache_memory=GiB))
    assert with_node_memory(given, 2, 5 * GiB).cache.available_memory is None
    with pytest.raises(ValueError, match="at least 1"):
        with_node_memory(config, 0, None)
