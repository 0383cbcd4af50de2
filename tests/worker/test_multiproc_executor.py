"""MultiprocExecutor's mechanics with model-free workers: broadcast and replies,
KV sizing over ranks, failures on any rank, worker death, and no orphans.
(Real models under tensor parallelism: tests/test_tensor_parallel.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from protocol import CachedRequestData, SchedulerOutput
from services.worker.multiproc_executor import MultiprocExecutor, WorkerFailedError, worker_config
from tests.polling import keep_for
from tests.worker.executor_fakes import FAKE_WORKER, fake_config

pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Deadline after which a step or a shutdown counts as hung; what is checked is
# that it ends at all (the failure comes from the dead rank's sentinel).
HANG_S = 30.0


def step(*req_ids: str) -> SchedulerOutput:
    return SchedulerOutput(
        [],
        CachedRequestData(list(req_ids), [[]] * len(req_ids), [1] * len(req_ids)),
        {r: 1 for r in req_ids},
        len(req_ids),
    )


def assert_all_gone(pids: list[int], timeout_s: float = 5.0) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    assert not alive, f"worker processes left behind: {alive}"


@pytest.fixture
def executor():
    executor = MultiprocExecutor(fake_config(3, num_threads=7), worker_class=FAKE_WORKER)
    yield executor
    executor.shutdown()


def test_steps_reach_every_rank_and_the_driver_answers(executor):
    assert executor.determine_num_blocks() == 80  # the fewest over ranks 0, 1, 2 (100, 90, 80)
    executor.initialize_cache(80)
    for n in (1, 64, 256):
        ids = [f"req-{i}" for i in range(n)]
        out = executor.execute_model(step(*ids))
        assert out.req_ids == ids
        assert out.sampled_token_ids == [[0, 2]] * n  # rank 0's answer; 7 threads // 3 ranks
    pids = [p.pid for p in executor.processes]
    executor.shutdown()
    executor.shutdown()
    assert all(p.exitcode == 0 for p in executor.processes)  # left their loop when told
    assert_all_gone(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        executor.execute_model(step("a"))


def test_torch_threads_are_divided_among_ranks():
    assert worker_config(fake_config(3, num_threads=2)).device.num_threads == 1
    assert worker_config(fake_config(2, num_threads=8)).device.num_threads == 4


def test_an_error_on_a_follower_fails_the_executor(executor):
    # Followers answer a step only when it fails. In a real model the driver
    # waits for them in its collectives, so their error comes first; these
    # fake ranks do not wait for each other, so it may come a few steps late.
    with pytest.raises(WorkerFailedError, match="rank 2 failed in ExecuteModel: boom on rank 2"):
        executor.execute_model(step("a", "fail-on-2"))
        keep_for(lambda: executor.execute_model(step("a")), 5)
    with pytest.raises(WorkerFailedError, match="rank 2"):  # the executor stays failed
        executor.execute_model(step("a"))


def test_a_start_up_error_is_raised_as_it_was_and_leaves_no_process():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="rank 1 refuses to start"):
        MultiprocExecutor(fake_config(2, name="refuse-start-on-1"), worker_class=FAKE_WORKER)
    # multiprocessing's resource tracker (started by the first spawn) lives as long as this process.
    after = {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    }
    assert_all_gone(list(after - before))


def test_sigkill_of_a_follower_mid_step_fails_the_step_instead_of_hanging(executor):
    events: list[str] = []  # in the order they happened
    failures: list[str] = []
    executor.register_failure_callback(lambda reason: (failures.append(reason), events.append("noticed")))
    raised: list[BaseException] = []

    def run_step() -> None:
        try:
            executor.execute_model(step("hang-on-0"))  # the driver blocks forever, as in a collective
        except BaseException as e:
            raised.append(e)
            events.append("step raised")

    thread = threading.Thread(target=run_step)
    thread.start()
    events.append("killed")
    os.kill(executor.processes[1].pid, signal.SIGKILL)
    thread.join(timeout=HANG_S)
    assert not thread.is_alive(), "the step still waits for a dead rank"
    assert events[0] == "killed" and sorted(events[1:]) == ["noticed", "step raised"]
    assert "rank 1" in failures[0] and "SIGKILL" in failures[0]
    assert isinstance(raised[0], WorkerFailedError) and "rank 1" in str(raised[0])
    pids = [p.pid for p in executor.processes]
    stopper = threading.Thread(target=executor.shutdown)  # the hung driver is killed, not waited for
    stopper.start()
    stopper.join(timeout=HANG_S)
    assert not stopper.is_alive(), "shutdown waits for the hung driver"
    assert_all_gone(pids)


def test_workers_die_with_their_engine_core(tmp_path):
    """SIGKILL the process that owns the executor: no worker survives it."""
    script = tmp_path / "owner.py"
    script.write_text(
        "import sys, threading\n"
        f"sys.path.insert(0, {REPO_ROOT!r})\n"
        "from services.worker.multiproc_executor import MultiprocExecutor\n"
        "from tests.worker.executor_fakes import FAKE_WORKER, fake_config\n"
        "if __name__ == '__main__':\n"
        "    executor = MultiprocExecutor(fake_config(2), worker_class=FAKE_WORKER)\n"
        "    print(*[p.pid for p in executor.processes], flush=True)\n"
        "    threading.Event().wait()\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
    assert_all_gone(pids)
