"""A CPU step runs on the worker's thread count, or on one thread below a threshold when one is set."""

from __future__ import annotations

import pytest
import torch

from services.worker.cpu_threads import DEFAULT_FEW_TOKENS, StepThreads, few_tokens


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_few_tokens_get_one_thread_the_rest_all():
    threads = StepThreads(num_threads=4, few=16)
    assert [threads.threads_for(n) for n in (1, 8, 15, 16, 2048)] == [1, 1, 1, 4, 4]
    assert StepThreads(num_threads=4, few=0).threads_for(1) == 4  # 0: never one thread


def test_entering_a_step_sets_torchs_count(restore_threads):
    threads = StepThreads(num_threads=2, few=16)
    threads.enter_step(1)
    assert torch.get_num_threads() == 1
    threads.enter_step(64)
    assert torch.get_num_threads() == 2
    threads.enter_step(3)
    assert torch.get_num_threads() == 1


def test_the_threshold_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("WEFT_CPU_ONE_THREAD_BELOW", raising=False)
    assert few_tokens() == DEFAULT_FEW_TOKENS == 0  # every step on the worker's count
    assert StepThreads(num_threads=2).threads_for(1) == 2
    monkeypatch.setenv("WEFT_CPU_ONE_THREAD_BELOW", "16")
    assert few_tokens() == 16
    assert StepThreads(num_threads=2).threads_for(15) == 1
    for bad in ("-1", "many"):
        monkeypatch.setenv("WEFT_CPU_ONE_THREAD_BELOW", bad)
        with pytest.raises(ValueError, match="WEFT_CPU_ONE_THREAD_BELOW must be a token count"):
            few_tokens()
