"""Data-parallel ranks on one node get their own GPUs (no GPU needed).

Each local engine core narrows CUDA_VISIBLE_DEVICES to its share before torch
loads, and its workers (which inherit it) take ``cuda:tp_rank`` within it. The
tests run that function in real processes with the environment a launcher
gives them, read what a worker process started by each of them sees, and
check that for every DP × TP layout the workers' physical devices are all
different and are the first DP × TP the node (or the user's
CUDA_VISIBLE_DEVICES) offers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.api import engine_processes
from services.engine_core import cli as engine_core_cli
from services.engine_core.devices import devices_of_rank
from services.engine_core.proc_args import EngineCoreArgs
from tests.utils import REPO_ROOT

# One engine core: narrow as the engine process does, then start a "worker" that reports what it sees.
ENGINE = """
import json, os, subprocess, sys
from services.engine_core.devices import narrow_visible_devices
local_dp_rank, tp = int(sys.argv[1]), int(sys.argv[2])
narrow_visible_devices(local_dp_rank, tp)
worker = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"
seen = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps(seen))
"""


def engine_sees(local_dp_rank: int, tp: int, inherited: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if inherited is not None:
        env["CUDA_VISIBLE_DEVICES"] = inherited
    result = subprocess.run(
        [sys.executable, "-c", ENGINE, str(local_dp_rank), str(tp)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(result.stdout).split(",")


USERS = [None, "4,5,6,7,0,1,2,3", "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f,GPU-g,GPU-h"]


def node_devices(user: str | None) -> list[str]:
    return [str(i) for i in range(8)] if user is None else user.split(",")


@pytest.mark.parametrize("dp, tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (2, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("user", USERS)
def test_every_worker_of_every_rank_gets_its_own_device(dp, tp, user):
    used = []
    for local_dp_rank in range(dp):
        seen = devices_of_rank(local_dp_rank, tp, user).split(",")
        assert len(seen) == tp  # each engine core sees exactly its share
        used += [seen[tp_rank] for tp_rank in range(tp)]  # worker tp_rank takes cuda:tp_rank
    # Each share is cut from what the node offers (or the user listed), in order, without overlap.
    assert used == node_devices(user)[: dp * tp]


@pytest.mark.parametrize("user", USERS[:2])
def test_each_engine_process_narrows_and_its_workers_inherit(user):
    """Real processes: the engine core narrows its own environment; a worker it starts sees that."""
    dp, tp = 2, 2
    seen = [engine_sees(local_dp_rank, tp, user) for local_dp_rank in range(dp)]
    assert [d for share in seen for d in share] == node_devices(user)[: dp * tp]


def test_a_user_list_too_short_for_the_layout_is_refused():
    with pytest.raises(ValueError, match="lists 2 device"):
        devices_of_rank(1, 2, "0,1")
    assert devices_of_rank(0, 2, "0, 1") == "0,1"


def test_hidden_devices_stay_hidden():
    """CUDA_VISIBLE_DEVICES="" (the user hid every GPU) is left as it is."""
    assert engine_sees(1, 1, "") == [""]


def test_the_launchers_tell_each_engine_its_place_on_the_node(monkeypatch):
    started = []
    monkeypatch.setattr(engine_processes.subprocess, "Popen", lambda argv, **_: started.append(argv))
    engine_processes.launch_local_engines(3, 2, "tcp://127.0.0.1:1")
    parsed = [EngineCoreArgs.parse(argv[3:]) for argv in started]
    assert [(a.rank, a.local_dp_rank) for a in parsed] == [(2, 0), (3, 1), (4, 2)]

    args = engine_core_cli.parse_args(
        ["--headless", "--dp-start-rank", "2", "--data-parallel-size", "4", "--data-parallel-size-local", "2"]
        + ["--data-parallel-address", "h", "--data-parallel-rpc-port", "1"]
    )
    ranks = [engine_core_cli.engine_args(args, rank, "tcp://h:1") for rank in (2, 3)]
    assert [(a.rank, a.local_dp_rank) for a in ranks] == [(2, 0), (3, 1)]
    assert EngineCoreArgs.parse(ranks[1].to_argv()[3:]).local_dp_rank == 1
