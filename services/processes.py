"""Stopping the child processes a launcher started (engine cores). Torch-free."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
# On SIGTERM, how long a server (the API, an engine core, the P/D proxy) lets the requests it holds
# finish before it stops anyway (each one's --shutdown-timeout).
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def stop_processes(
    processes: Sequence[subprocess.Popen], grace_s: float = STOP_GRACE_S, exit_wait_s: float = 0.0
) -> None:
    """Give the processes ``exit_wait_s`` to exit on their own, SIGTERM those
    still running, and SIGKILL those that outlive ``grace_s`` more."""
    deadline = time.monotonic() + exit_wait_s
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    for proc in processes:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("Process %d ignored SIGTERM; killing it.", proc.pid)
            proc.kill()
            proc.wait()
