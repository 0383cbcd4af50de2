"""The engine's torch threads when ``--num-threads`` is not given: ``OMP_NUM_THREADS`` where it is
set (torch's own default reads it, and weft sets the count itself, so it would otherwise be lost),
else the machine's cores shared by the local engines. An asked count wins over both."""

from __future__ import annotations

import os

import pytest

from services.config.engine_args import EngineArgs


def threads(**kwargs) -> int:
    return EngineArgs(device="cpu", **kwargs).create_engine_config().device.num_threads


def test_omp_num_threads_is_the_default(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads() == 3
    assert threads(data_parallel_size=2) == 3  # per engine process, as torch reads it
    assert threads(num_threads=5) == 5


def test_without_it_the_cores_are_shared_by_the_local_engines(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert threads() == 8
    assert threads(data_parallel_size=2) == 4
    assert threads(num_threads=3) == 3


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_value_is_refused(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a thread count"):
        threads()
