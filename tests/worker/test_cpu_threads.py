"""A CPU step of a few tokens runs on one torch thread, a larger one on the worker's count."""

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
    assert few_tokens() == DEFAULT_FEW_TOKENS
    monkeypatch.setenv("WEFT_CPU_ONE_THREAD_BELOW", "0")
    assert few_tokens() == 0
    assert StepThreads(num_threads=2).few == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv("WEFT_CPU_ONE_THREAD_BELOW", bad)
        with pytest.raises(ValueError, match="WEFT_CPU_ONE_THREAD_BELOW must be a token count"):
            few_tokens()
