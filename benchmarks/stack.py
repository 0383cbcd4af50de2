"""A ``weft serve`` stack in a subprocess, started, watched, damaged and stopped
from outside: the harness of ``weft bench soak`` and of the reliability tests.

Everything is read from outside, as an operator would: ``/health`` for rank
states, load and free KV blocks, ``/proc`` for the processes (the engine
cores are the API's children) and their resident memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.ports import free_port

_ENGINE_MODULE = "services.engine_core.proc"


@dataclass(frozen=True)
class EngineProcess:
    pid: int
    rank: int


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a live process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _children(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every live process whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The command name (2nd field) may hold spaces: split after its ')'.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        found.append((int(entry), argv))
    return found


class Stack:
    """``weft serve`` (API + local engine cores) on loopback, logs in ``log_dir``."""

    def __init__(
        self,
        serve_args: list[str],
        log_dir: Path,
        *,
        startup_timeout_s: float = 300.0,
        tls: dict | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``tls``: the server serves HTTPS (its --ssl-* flags are in ``serve_args``); these are the
        httpx settings that reach it (``verify``, and ``cert`` where it asks for a client's).
        ``env``: variables added to this process's for the stack (tests' fault injection)."""
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.http_options = tls or {}
        self.log_path = Path(log_dir) / "serve.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.startup_timeout_s = startup_timeout_s
        self._log = open(self.log_path, "wb")
        # No OMP_NUM_THREADS of its own: engines take it as their default --num-threads, so the
        # caller's environment (one thread under the tests' workers) or serve_args decide.
        env = os.environ | (env or {})
        # Its own session: stop() and kill() reach the API alone; its engine
        # cores must go because the API stops them (or dies).
        self.api = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *serve_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.seen_engine_pids: set[int] = set()

    def log_tail(self, num_bytes: int = 4000) -> str:
        return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")

    def wait_healthy(self, timeout_s: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        while True:
            if self.api.poll() is not None:
                raise RuntimeError(f"weft serve exited with code {self.api.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(self.url + "/health", timeout=5, **self.http_options)
                if response.status_code == 200:
                    return response.json()
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"The stack was not healthy in time:\n{self.log_tail()}")
            time.sleep(0.2)  # polling an outside process, with a deadline

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10, **self.http_options).json()

    def engines(self) -> list[EngineProcess]:
        """The live engine-core processes (children of the API)."""
        found = []
        for pid, argv in _children(self.api.pid):
            if _ENGINE_MODULE in argv and "--rank" in argv:
                found.append(EngineProcess(pid, int(argv[argv.index("--rank") + 1])))
                self.seen_engine_pids.add(pid)
        return sorted(found, key=lambda e: e.rank)

    def kill_engine(self, rank: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to ``rank``'s engine core; returns its pid."""
        (engine,) = [e for e in self.engines() if e.rank == rank]
        os.kill(engine.pid, sig)
        return engine.pid

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the API (it drains and stops its engines); its exit code,
        or None if it had to be killed."""
        if self.api.poll() is None:
            self.engines()  # remember every engine pid, to check they all go
            self.api.send_signal(signal.SIGTERM)
            try:
                return self.api.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.api.returncode

    def kill(self) -> None:
        for pid in [e.pid for e in self.engines()] + [self.api.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.api.wait()
        self._log.close()

    def survivors(self, timeout_s: float = 10.0) -> list[int]:
        """Engine pids ever seen that are still alive after ``timeout_s`` (orphans)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [pid for pid in self.seen_engine_pids if rss_bytes(pid) is not None]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)
