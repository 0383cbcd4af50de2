"""``weft bench serve`` without ``--base-url``: what the HTTP stack costs on top of the engine.

Runs the workload twice in one go: offline through ``LLM.generate``, then
through a ``weft serve`` subprocess started here (one data-parallel rank, the same engine
arguments) as streaming completions, ``--max-concurrency`` at a time. Prints
both output token rates, their ratio, and the cores the API process used
(its CPU time over the timed window's wall time; the engine core is a
separate process and not counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from benchmarks.bench.serve_client import ClientConfig, run_benchmark, send_one
from benchmarks.bench.workload import Workload, WorkloadRequest
from services.config.engine_args import EngineArgs
from services.ports import free_port

_STARTUP_DEADLINE_S = 300.0
STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class ServeResult:
    """The HTTP run's figures."""

    num_requests: int
    output_tokens: int
    elapsed_s: float
    api_cpu_s: float  # user + system time of the API process in the timed window

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def api_cores(self) -> float:
        return self.api_cpu_s / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "output_tokens_per_s": self.output_tokens_per_s,
            "api_cores": self.api_cores,
        }


def serve_argv(engine_args: EngineArgs, port: int) -> list[str]:
    """``weft serve`` arguments for ``engine_args`` on one local rank."""
    argv = ["--host", "127.0.0.1", "--port", str(port)]
    for f in dataclasses.fields(EngineArgs):
        value = getattr(engine_args, f.name)
        if f.name == "data_parallel_size" or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv + ["--data-parallel-size", "1"]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (not its children), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        # Field 2 (the name) may hold spaces: split after its closing parenthesis.
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """A ``weft serve`` subprocess in its own session (stopped as a group)."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        # The management routes (the sweeps' /reset_prefix_cache) need an admin key: a fresh one,
        # handed over in the environment (a flag would show in `ps`).
        self.admin_key = secrets.token_urlsafe(24)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", *argv],
            start_new_session=True,
            env={**os.environ, "WEFT_ADMIN_API_KEY": self.admin_key},
        )

    def wait_healthy(self, deadline_s: float = _STARTUP_DEADLINE_S) -> None:
        import httpx

        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weft serve exited with code {self.proc.returncode} during start-up.")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # start-up takes seconds: poll until the deadline
        raise RuntimeError(f"weft serve was not healthy within {deadline_s:.0f}s.")

    def stop(self) -> None:
        """SIGTERM (the API stops its engine cores), then SIGKILL the group if it lingers."""
        stop_process_group(self.proc)  # engine cores left behind, if any


def stop_process_group(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM ``proc``, wait up to ``grace_s`` for it, then SIGKILL its process group
    (it leads its own session) for any children it left behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_serve(
    workload: Workload,
    engine_args: EngineArgs,
    model_name: str,
    concurrency: int,
    quiet: bool = True,
    slos: dict[str, float] | None = None,
) -> tuple[ServeResult, dict[str, Any]]:
    """Start ``weft serve``, warm it up with one request, stream the workload
    through ``serve_client`` (all at once, ``concurrency`` in flight), stop it.
    Returns the run's totals and the client's full metrics report."""
    with launched_server(engine_args, model_name, workload) as server:
        config = ClientConfig(base_url=server.url, model=model_name, max_concurrency=concurrency, quiet=quiet)
        cpu_before = _cpu_seconds(server.proc.pid)
        report = asyncio.run(run_benchmark(config, workload, slos))
        cpu = _cpu_seconds(server.proc.pid) - cpu_before
    result = ServeResult(
        num_requests=report["completed"],
        output_tokens=report["total_output_tokens"],
        elapsed_s=report["duration_s"],
        api_cpu_s=cpu,
    )
    return result, report


@contextlib.contextmanager
def launched_server(engine_args: EngineArgs, model_name: str, workload: Workload) -> Iterator[ServerProcess]:
    """A healthy ``weft serve`` for ``engine_args``, warmed up by one short request
    of the workload, stopped on the way out."""
    port = free_port()
    server = ServerProcess(serve_argv(engine_args, port), port)
    try:
        server.wait_healthy()
        warm = msgspec.structs.replace(workload.requests[0], max_tokens=4)
        record = asyncio.run(_warm_up(ClientConfig(base_url=server.url, model=model_name), warm))
        if not record.ok:
            raise RuntimeError(f"weft serve failed its warm-up request: {record.error}")
        yield server
    finally:
        server.stop()


async def _warm_up(config: ClientConfig, request: WorkloadRequest) -> Any:
    import httpx

    async with httpx.AsyncClient(timeout=None) as http:
        return await send_one(http, config, request)
