"""Soak and chaos test: a stack under steady random load, engine cores killed at intervals.

``weft bench soak --duration 600 --chaos-interval 15`` starts
``weft serve`` (two local engine cores by default), runs ``--concurrency``
clients sending random streaming and non-streaming requests (some of them
hanging up early, and waiting as a 503's Retry-After asks), SIGKILLs a
random ready engine core every ``--chaos-interval`` seconds (while another
stays ready), then lets the stack quiesce and checks:

- every request completed, failed with a clear error, or was left by its
  client: ``lost`` must be 0;
- no error outside the chaos windows (a kill until its rank is ready again,
  plus a little grace);
- no KV block still in use once the stack is idle, on any rank;
- every killed rank came back and served again;
- RSS of the API and the engine cores, from start (after warm-up) to end;
- no engine process left once the API was stopped with SIGTERM.

Extra arguments go to ``weft serve`` as they are (``-- --max-num-seqs 64``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.bench.soak_clients import ClientParams, ClientPool, RequestResult
from benchmarks.stack import Stack, rss_bytes

_POLL_S = 0.2
_MIB = 1024 * 1024


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    concurrency: int = 16
    chaos_interval_s: float | None = None  # None: no chaos
    disconnect_prob: float = 0.1
    max_tokens: int = 64
    seed: int = 0
    warmup_s: float = 10.0  # RSS is measured from here (allocators and caches fill first)
    window_grace_s: float = 2.0  # errors this long after a killed rank is back still count as chaos
    quiesce_timeout_s: float = 120.0
    client_timeout_s: float = 300.0


@dataclass
class ChaosEvent:
    rank: int
    pid: int
    killed_at: float  # seconds since the soak started
    back_at: float | None = None  # ready again (a new process)
    routed_when_back: int = 0  # the rank's num_routed then: it must grow afterwards


@dataclass
class SoakReport:
    duration_s: float
    concurrency: int
    chaos_interval_s: float | None
    sent: int = 0
    completed: int = 0
    failed_with_error: int = 0
    disconnected: int = 0
    lost: int = 0
    failures_by_cause: dict[str, int] = field(default_factory=dict)
    lost_causes: dict[str, int] = field(default_factory=dict)
    errors_outside_chaos: int = 0
    requests_outside_chaos: int = 0
    kills: list[ChaosEvent] = field(default_factory=list)
    killed_ranks_serving_again: bool = True
    leaked_blocks: dict[int, int] = field(default_factory=dict)
    quiesced: bool = False
    rss_mib: dict[str, list[float | None]] = field(default_factory=dict)  # process -> [start, end]
    orphans: list[int] | None = None  # engine pids alive after the API stopped (None: not checked)

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.errors_outside_chaos == 0
            and self.quiesced
            and not any(self.leaked_blocks.values())
            and self.killed_ranks_serving_again
            and not self.orphans
        )  # None (not checked) or empty

    def table(self) -> str:
        chaos = (
            f"SIGKILL an engine core every {self.chaos_interval_s:g}s ({len(self.kills)} kills)"
            if self.chaos_interval_s
            else "off"
        )
        causes = ", ".join(f"{k}: {v}" for k, v in sorted(self.failures_by_cause.items())) or "-"
        rate = self.errors_outside_chaos / max(1, self.requests_outside_chaos)
        rows = [
            ("duration / clients", f"{self.duration_s:.0f}s / {self.concurrency} concurrent"),
            ("chaos", chaos),
            ("requests sent", self.sent),
            ("  completed", self.completed),
            ("  failed with an error", f"{self.failed_with_error}  ({causes})"),
            ("  left by their client", self.disconnected),
            ("  lost", f"{self.lost}  {dict(self.lost_causes) or ''}"),
            (
                "errors outside chaos windows",
                f"{self.errors_outside_chaos} of {self.requests_outside_chaos} ({100 * rate:.2f}%)",
            ),
            ("KV blocks leaked after quiesce", self.leaked_blocks if self.quiesced else "did not quiesce"),
            ("killed ranks serving again", "yes" if self.killed_ranks_serving_again else "NO"),
            *((f"RSS {name} (MiB)", _rss_row(v)) for name, v in sorted(self.rss_mib.items())),
            (
                "engine processes left after SIGTERM",
                "not checked" if self.orphans is None else len(self.orphans),
            ),
            ("verdict", "PASS" if self.ok else "FAIL"),
        ]
        return "\n".join(f"{name:38} {value}" for name, value in rows)


def _rss_row(values: list[float | None]) -> str:
    start, end = values
    if start is None:
        return f"started during the run -> {end:.1f}"
    if end is None:
        return f"{start:.1f} -> killed"
    return f"{start:.1f} -> {end:.1f} ({end - start:+.1f})"


async def run_soak(stack: Stack, config: SoakConfig, model: str) -> SoakReport:
    """Load ``stack`` (already healthy) for ``config.duration_s``, then quiesce and measure."""
    report = SoakReport(config.duration_s, config.concurrency, config.chaos_interval_s)
    params = ClientParams(model, config.max_tokens, config.disconnect_prob, config.client_timeout_s)
    limits = httpx.Limits(
        max_connections=config.concurrency + 8, max_keepalive_connections=config.concurrency
    )
    async with httpx.AsyncClient(base_url=stack.url, timeout=None, limits=limits) as http:
        pool = ClientPool(http, params, config.concurrency, config.seed)
        start = time.monotonic()
        load = asyncio.create_task(pool.run())
        try:
            await asyncio.sleep(min(config.warmup_s, config.duration_s / 2))
            rss_start = _rss(stack)
            if config.chaos_interval_s:
                await _chaos(stack, http, config, start, report.kills)
            await asyncio.sleep(max(0.0, start + config.duration_s - time.monotonic()))
            pool.stop()
            await load
        finally:  # interrupted or not, no client outlives the soak
            pool.stop()
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
        report.quiesced, report.leaked_blocks, final = await _quiesce(http, config.quiesce_timeout_s)
    rss_end = _rss(stack)
    report.rss_mib = {
        name: [rss_start.get(name), rss_end.get(name)] for name in rss_start.keys() | rss_end.keys()
    }
    _count(report, pool.results, start, config.window_grace_s)
    report.killed_ranks_serving_again = all(
        e.back_at is not None and final.get(e.rank, 0) > e.routed_when_back for e in report.kills
    )
    return report


def _rss(stack: Stack) -> dict[str, float | None]:
    """MiB per process: the API, and each engine core by rank and pid (a restart is a new one)."""
    found = {"api": rss_bytes(stack.api.pid)}
    for engine in stack.engines():
        found[f"engine {engine.rank} (pid {engine.pid})"] = rss_bytes(engine.pid)
    return {name: None if value is None else value / _MIB for name, value in found.items()}


async def _health(http: httpx.AsyncClient) -> dict:
    return (await http.get("/health", timeout=10)).json()


async def _chaos(
    stack: Stack, http: httpx.AsyncClient, config: SoakConfig, start: float, events: list[ChaosEvent]
) -> None:
    """Kill a ready rank every interval until the load stops; wait for each to come back.

    Only while another rank stays ready: the point is a stack that loses a
    part and keeps serving, not one with nothing left (a tick that finds a
    single ready rank is skipped)."""
    rng = random.Random(config.seed)
    next_kill = start + config.chaos_interval_s
    watchers: list[asyncio.Task] = []
    try:
        # The last kill leaves room for the rank to come back and serve before the end.
        while next_kill < start + config.duration_s - config.chaos_interval_s / 2:
            await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
            next_kill += config.chaos_interval_s
            ready = {r["rank"] for r in (await _health(http))["ranks"] if r["state"] == "ready"}
            targets = sorted(ready & {e.rank for e in stack.engines()})
            if len(ready) < 2 or not targets:
                continue
            rank = rng.choice(targets)
            event = ChaosEvent(rank, stack.kill_engine(rank), time.monotonic() - start)
            events.append(event)
            watchers.append(asyncio.create_task(_mark_back(stack, http, event, start)))
        await asyncio.wait_for(asyncio.gather(*watchers), config.quiesce_timeout_s)
    except TimeoutError:
        pass  # a rank that never came back: back_at stays None, and the report says so
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)


async def _mark_back(stack: Stack, http: httpx.AsyncClient, event: ChaosEvent, start: float) -> None:
    """Set ``back_at`` once a new process of the killed rank is ready."""
    while True:
        await asyncio.sleep(_POLL_S)
        pids = {e.pid for e in stack.engines() if e.rank == event.rank}
        rank = {r["rank"]: r for r in (await _health(http))["ranks"]}[event.rank]
        if rank["state"] == "ready" and pids and event.pid not in pids:
            event.back_at = time.monotonic() - start
            event.routed_when_back = rank["num_routed"]
            return


async def _quiesce(http: httpx.AsyncClient, timeout_s: float) -> tuple[bool, dict[int, int], dict[int, int]]:
    """Wait for every rank to be ready and idle; (quiesced, leaked blocks by rank, num_routed by rank)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = await _health(http)
        ranks = health["ranks"]
        leaked = {r["rank"]: r["num_blocks"] - 1 - r["num_free_blocks"] for r in ranks}
        idle = health.get("admitted", 0) == 0 and all(
            r["state"] == "ready"
            and r["num_running"] == 0
            and r["num_waiting"] == 0
            and r.get("num_in_flight", 0) == 0
            for r in ranks
        )
        if (idle and not any(leaked.values())) or time.monotonic() > deadline:
            return idle, leaked, {r["rank"]: r["num_routed"] for r in ranks}
        await asyncio.sleep(_POLL_S)


def _count(report: SoakReport, results: list[RequestResult], start: float, grace_s: float) -> None:
    windows = [
        (e.killed_at, (e.back_at if e.back_at is not None else float("inf")) + grace_s) for e in report.kills
    ]
    causes: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    for r in results:
        report.sent += 1
        in_chaos = any(lo <= r.end - start <= hi for lo, hi in windows)
        report.requests_outside_chaos += not in_chaos
        if r.outcome == "completed":
            report.completed += 1
        elif r.outcome == "disconnected":
            report.disconnected += 1
        elif r.outcome == "error":
            report.failed_with_error += 1
            causes[r.cause] += 1
            report.errors_outside_chaos += not in_chaos
        else:
            report.lost += 1
            lost[r.cause] += 1
    report.failures_by_cause, report.lost_causes = dict(causes), dict(lost)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="weft bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="Seconds of load.")
    parser.add_argument("--concurrency", type=int, default=16, help="Clients sending at once.")
    parser.add_argument(
        "--chaos-interval",
        type=float,
        default=None,
        help="SIGKILL a random engine core this often (seconds; default: no chaos).",
    )
    parser.add_argument(
        "--disconnect-prob", type=float, default=0.1, help="Share of clients that hang up early."
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="Largest max_tokens of a random request.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", default=None, help="Model for weft serve (default: SmolLM2-135M-Instruct)."
    )
    parser.add_argument("--data-parallel-size", type=int, default=2, help="Local engine cores.")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="Where weft serve's log goes (default: a temp dir)."
    )
    parser.add_argument("--output-json", type=Path, default=None, help="Also write the report here.")
    args, serve_args = parser.parse_known_args(argv)
    if args.duration <= 0 or args.concurrency < 1 or not 0 <= args.disconnect_prob <= 1:
        parser.error("--duration must be > 0, --concurrency >= 1 and --disconnect-prob in [0, 1].")
    if args.chaos_interval is not None and args.chaos_interval <= 0:
        parser.error("--chaos-interval must be positive.")
    return args, [a for a in serve_args if a != "--"]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM too stops the soak through its clean-up


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    args, serve_args = parse_args(argv)
    from services.model_files import resolve

    files = resolve(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="weft-soak-"))
    stack = Stack(
        ["--model", str(files.weights), "--data-parallel-size", str(args.data_parallel_size), *serve_args],
        log_dir,
    )
    config = SoakConfig(
        duration_s=args.duration,
        concurrency=args.concurrency,
        chaos_interval_s=args.chaos_interval,
        disconnect_prob=args.disconnect_prob,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    try:
        served = stack.wait_healthy()
        print(
            f"Stack ready ({len(served['ranks'])} engine cores); soaking for {args.duration:.0f}s. "
            f"Log: {stack.log_path}",
            file=sys.stderr,
        )
        report = asyncio.run(run_soak(stack, config, files.name))
        stack.stop()
        report.orphans = stack.survivors()
    finally:
        stack.kill()  # whatever is left, if anything failed above
    print(report.table())
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.ok else 1
