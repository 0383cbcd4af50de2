"""The engine-core processes the API started on its own node.

``launch_local_engines`` starts them; ``LocalEngines`` watches them for the
engine client and restarts one that exits, with exponential back-off for a
rank that keeps dying soon after it became ready (a crash loop; a slow model
load does not count as serving), and at once (``base_s``) for one that had
served a while. A rank that never became ready is not restarted at all: the
engine client stops the API instead (``DPLBEngineClient.start_failure``).
Torch-free.

Engines run in their own session, so a terminal's Ctrl-C reaches only the
API, which stops them in order; each engine asks the kernel to kill it when
the thread that started it exits (``die_with_launcher`` in
``services.engine_core.proc``), so every ``Popen`` here must run on a
long-lived thread -- the event loop's, never a ``to_thread`` worker.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine_core.proc_args import EngineCoreArgs
from services.processes import DEFAULT_SHUTDOWN_TIMEOUT_S, STOP_GRACE_S, stop_processes

logger = logging.getLogger(__name__)


def engine_command(
    rank: int,
    handshake_address: str,
    *,
    num_threads: int | None = None,
    curve_keys: str | None = None,
    shutdown_timeout_s: float | None = None,
    local_dp_rank: int | None = None,
) -> list[str]:
    """The command that starts local engine core ``rank`` (``local_dp_rank``-th on this node)."""
    timeout_s = DEFAULT_SHUTDOWN_TIMEOUT_S if shutdown_timeout_s is None else shutdown_timeout_s
    return EngineCoreArgs(
        rank=rank,
        handshake_address=handshake_address,
        local=True,
        num_threads=num_threads,
        curve_keys=None if curve_keys is None else str(curve_keys),
        shutdown_timeout_s=timeout_s,
        local_dp_rank=local_dp_rank,
    ).to_argv()


def launch_local_engines(
    num: int,
    start_rank: int,
    handshake_address: str,
    num_threads: int | None = None,
    *,
    curve_keys: str | None = None,
    shutdown_timeout_s: float | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start ranks ``start_rank..start_rank+num-1`` on this node (stdout/stderr inherited).

    Plain subprocesses: the config reaches them over the handshake, never pickled.
    """
    return [
        subprocess.Popen(
            engine_command(
                rank,
                handshake_address,
                num_threads=num_threads,
                curve_keys=curve_keys,
                shutdown_timeout_s=shutdown_timeout_s,
                local_dp_rank=rank - start_rank,
            ),
            start_new_session=True,
        )
        for rank in range(start_rank, start_rank + num)
    ]


@dataclass
class RestartBackoff:
    """Delay before restarting a rank: ``base_s`` after a life of at least
    ``stable_s``, doubling (up to ``max_s``) for each quicker death in a row."""

    base_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 30.0
    _quick_deaths: dict[int, int] = field(default_factory=dict)

    def delay(self, rank: int, lifetime_s: float) -> float:
        quick = self._quick_deaths.get(rank, 0) + 1 if lifetime_s < self.stable_s else 0
        self._quick_deaths[rank] = quick
        return min(self.max_s, self.base_s * 2.0 ** max(0, quick - 1))


class LocalEngines:
    """Rank -> process of the engines started here, restarting them if asked."""

    def __init__(
        self,
        processes: dict[int, subprocess.Popen[bytes]],
        *,
        restart: bool = False,
        backoff: RestartBackoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.processes = dict(processes)
        self.restart = restart
        self.backoff = backoff or RestartBackoff()
        self.num_restarts = {rank: 0 for rank in self.processes}
        self._clock = clock
        # When each rank's current process said it was ready (None: not yet).
        # Its life counts from there: one that crashes right after a long load
        # is in a crash loop as much as one that crashes at once.
        self._ready_at: dict[int, float | None] = {rank: None for rank in self.processes}
        self._due: dict[int, float] = {}  # rank -> when to start it again

    def __contains__(self, rank: int) -> bool:
        return rank in self.processes

    def exit_code(self, rank: int) -> int | None:
        """The exit code if ``rank``'s process has exited (and is not about to be restarted)."""
        proc = self.processes.get(rank)
        return None if proc is None or rank in self._due else proc.poll()

    def on_ready(self, rank: int) -> None:
        """``rank``'s current process finished loading and serves."""
        if rank in self._ready_at and self._ready_at[rank] is None:
            self._ready_at[rank] = self._clock()

    def on_dead(self, rank: int, *, hung: bool = False) -> None:
        """The client marked ``rank`` dead: kill its process if it ``hung``
        (went silent), and plan its restart."""
        proc = self.processes.get(rank)
        if proc is None:
            return
        if hung and proc.poll() is None:
            proc.kill()
        if self.restart and rank not in self._due:
            now = self._clock()
            ready_at = self._ready_at[rank]
            delay = self.backoff.delay(rank, 0.0 if ready_at is None else now - ready_at)
            self._due[rank] = now + delay
            logger.info("Restarting engine core rank %d in %.1fs.", rank, delay)

    def restart_due(self) -> list[int]:
        """Start again every rank whose back-off is over and whose old process
        has exited (one that said goodbye gets ``STOP_GRACE_S`` to do so);
        returns those ranks."""
        now = self._clock()
        ranks = []
        for rank, due in list(self._due.items()):
            old = self.processes[rank]
            if due > now:
                continue
            if old.poll() is None:
                if now > due + STOP_GRACE_S:
                    old.kill()
                continue
            ranks.append(rank)
            self.processes[rank] = subprocess.Popen(old.args, start_new_session=True)
            self._ready_at[rank] = None
            self.num_restarts[rank] += 1
            del self._due[rank]
            logger.info(
                "Engine core rank %d restarted (pid %d, restart #%d).",
                rank,
                self.processes[rank].pid,
                self.num_restarts[rank],
            )
        return ranks

    def stop(self, grace_s: float = STOP_GRACE_S, exit_wait_s: float = 0.0) -> None:
        self.restart = False
        self._due.clear()
        stop_processes(list(self.processes.values()), grace_s=grace_s, exit_wait_s=exit_wait_s)
