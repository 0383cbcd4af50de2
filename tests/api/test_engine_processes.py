"""Restarting local engine processes, with stand-in processes (no model)."""

from __future__ import annotations

import signal
import subprocess
import sys

from services.api.engine_processes import LocalEngines, RestartBackoff, engine_command
from tests.polling import wait_for

SLEEPER = [sys.executable, "-c", "import signal; signal.pause()"]  # alive until it is killed


def test_backoff_doubles_for_quick_deaths_and_resets_after_a_long_life():
    backoff = RestartBackoff(base_s=1.0, max_s=8.0, stable_s=30.0)
    assert [backoff.delay(0, lifetime_s=2.0) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff.delay(1, lifetime_s=2.0) == 1.0  # per rank
    assert backoff.delay(0, lifetime_s=60.0) == 1.0  # it had served a while: not a crash loop
    assert backoff.delay(0, lifetime_s=2.0) == 1.0


def test_engine_command_passes_the_security_and_drain_flags():
    cmd = engine_command(3, "tcp://10.0.0.1:5000", num_threads=2, curve_keys="/keys", shutdown_timeout_s=7.5)
    assert cmd[cmd.index("--rank") + 1] == "3" and "--local" in cmd
    assert cmd[cmd.index("--zmq-curve-keys") + 1] == "/keys"
    assert cmd[cmd.index("--shutdown-timeout") + 1] == "7.5"


def test_a_dead_process_is_restarted_after_its_backoff_and_stop_ends_all():
    first = subprocess.Popen(SLEEPER, start_new_session=True)
    engines = LocalEngines({4: first}, restart=True, backoff=RestartBackoff(base_s=0.2))
    try:
        assert 4 in engines and engines.exit_code(4) is None
        first.send_signal(signal.SIGKILL)
        wait_for(lambda: engines.exit_code(4) is not None, 10, "rank 4 to exit", interval_s=0.02)
        engines.on_dead(4)
        assert engines.exit_code(4) is None  # planned for restart: not "exited" any more
        assert engines.restart_due() == []  # still backing off
        wait_for(lambda: engines.restart_due() == [4], 10, "rank 4's restart to fall due", interval_s=0.02)
        second = engines.processes[4]
        assert second.pid != first.pid and second.poll() is None and second.args == first.args
        assert engines.num_restarts[4] == 1
    finally:
        engines.stop(grace_s=5)
    assert engines.processes[4].poll() is not None and engines.restart is False


def test_a_hung_process_is_killed_and_no_restart_unless_asked():
    proc = subprocess.Popen(SLEEPER, start_new_session=True)
    engines = LocalEngines({0: proc}, restart=False)
    engines.on_dead(0, hung=True)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert engines.restart_due() == [] and engines.processes[0] is proc


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _die_and_restart(engines: LocalEngines, rank: int) -> float:
    """Kill ``rank``'s process, report it dead; returns the back-off it got."""
    proc = engines.processes[rank]
    proc.kill()
    proc.wait(timeout=10)
    engines.on_dead(rank)
    delay = engines._due[rank] - engines._clock()
    engines._clock.now += delay
    assert engines.restart_due() == [rank]
    return delay


def test_backoff_counts_the_life_from_ready_not_from_spawn():
    """A model that loads for 100 s and crashes 1 s after ready is a crash loop:
    its back-off doubles, although each process lived longer than ``stable_s``."""
    clock = FakeClock()
    engines = LocalEngines(
        {0: subprocess.Popen(SLEEPER, start_new_session=True)},
        restart=True,
        backoff=RestartBackoff(base_s=1.0, max_s=64.0, stable_s=30.0),
        clock=clock,
    )
    try:
        delays = []
        for _ in range(3):
            clock.now += 100.0  # loading
            engines.on_ready(0)
            clock.now += 1.0  # serving, briefly
            delays.append(_die_and_restart(engines, 0))
        assert delays == [1.0, 2.0, 4.0]
        clock.now += 100.0
        engines.on_ready(0)
        clock.now += 60.0  # served a while: a fresh start
        assert _die_and_restart(engines, 0) == 1.0
        # Never ready at all, however long it loaded: quick deaths.
        clock.now += 500.0
        assert _die_and_restart(engines, 0) == 1.0
        clock.now += 500.0
        assert _die_and_restart(engines, 0) == 2.0
    finally:
        engines.stop(grace_s=5)
