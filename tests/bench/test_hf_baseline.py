"""The HF baseline on the real default model (GGUF dequantized, fp32).

Loading the model takes ~15 s, so the session's model (``hf_default_model``,
which ``load_hf_model`` loaded) serves every test, and the runs are the first
requests of smoke-8 (a few tokens each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.hf_baseline import generate_batch, run_hf_baseline
from benchmarks.bench.workload import Workload, load_workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_model(hf_default_model) -> Any:
    return hf_default_model


@pytest.fixture(scope="module")
def smoke2(workloads_dir: Path) -> Workload:
    return load_workload(workloads_dir / "smoke-8.json").head(2)


def test_counts_only_each_requests_own_tokens(hf_model: Any, smoke2: Workload) -> None:
    result = run_hf_baseline(smoke2, hf_model, batch_size=16)
    assert result.backend == "hf"
    assert result.num_requests == 2
    assert result.prompt_tokens == 47 + 31
    assert result.output_tokens == 8 + 10
    # One batch of two rows, both decoded to the batch's longest (10).
    assert result.details["generated_tokens"] == 2 * 10
    assert result.details["dtype"] == "float32"
    assert result.elapsed_s > 0
    assert result.output_tokens_per_s == pytest.approx(18 / result.elapsed_s)
    assert result.total_tokens_per_s == pytest.approx((78 + 18) / result.elapsed_s)


def test_batches_follow_workload_order(hf_model: Any, smoke2: Workload) -> None:
    result = run_hf_baseline(smoke2, hf_model, batch_size=1)
    assert result.output_tokens == 18
    assert result.details["generated_tokens"] == 8 + 10  # no padding waste at batch 1


def test_left_padding_does_not_change_greedy_outputs(hf_model: Any, smoke2: Workload) -> None:
    first, second = smoke2.requests  # 47 and 31 prompt tokens: the second is padded
    batched = generate_batch(hf_model, [first, second])
    alone = generate_batch(hf_model, [first]) + generate_batch(hf_model, [second])
    assert [len(tokens) for tokens in batched] == [8, 10]
    assert batched == alone


def test_bad_batch_size_is_refused(hf_model: Any, smoke2: Workload) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        run_hf_baseline(smoke2, hf_model, batch_size=0)
