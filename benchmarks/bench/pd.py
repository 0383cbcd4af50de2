"""``weft bench pd``: disaggregated prefill/decode vs one colocated engine, on one machine.

1. Transfer cost: blocks of the default model (fp32) saved and loaded by a
   worker's transfer thread, through ``weft kv-transfer`` and through a
   shared folder: bytes per block, ms per block.
2. ``weft bench serve`` with ``pd-mixed.json`` (streams, then 2,000+ token
   prompts arriving while they decode) against one ``weft serve`` that does
   everything, then against ``weft pd-proxy`` in front of a prefill and a
   decode ``weft serve`` with the ZmqConnector.

Both setups get the same two cores: the colocated engine runs 2 torch
threads, the prefill and decode engines 1 each.

    weft bench pd [--request-rate 2] [--out bench-results/pd]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from services.kv_transfer.pd_up import kv_transfer_config, kv_transfer_service_argv
from services.model_files import REPO_ROOT
from services.ports import free_port

WORKLOAD = "pd-mixed"  # benchmarks/workloads/pd-mixed.json
ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "2304",
    "--max-num-batched-tokens",
    "512",
    "--num-gpu-blocks-override",
    "700",
    "--max-num-seqs",
    "16",
]
STARTUP_S = 600.0


class Processes:
    """Processes of one setup, each in its own session, logs in ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def weft(self, name: str, *argv: str) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:  # the child keeps it open
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=REPO_ROOT,
            )

    def wait_healthy(self, url: str) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; see {self.log_dir}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{url} not healthy in {STARTUP_S}s; see {self.log_dir}")

    def close(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def bench_serve(url: str, rate: float, result: Path) -> dict:
    """``weft bench serve`` against ``url``; returns its JSON report."""
    httpx.post(url + "/v1/completions", json={"prompt": "Warm up.", "max_tokens": 4}, timeout=300)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "bench",
            "serve",
            "--base-url",
            url,
            "--dataset",
            WORKLOAD,
            "--request-rate",
            str(rate),
            "--seed",
            "0",
            "--result-json",
            str(result),
            "--quiet",
        ],
        check=True,
        cwd=REPO_ROOT,
    )
    return json.loads(result.read_text())


def run_colocated(out: Path, rate: float) -> dict:
    procs = Processes(out / "logs-colocated")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        procs.weft(
            "serve", "serve", "--host", "127.0.0.1", "--port", str(port), "--num-threads", "2", *ENGINE_ARGS
        )
        procs.wait_healthy(url)
        return bench_serve(url, rate, out / "colocated.json")
    finally:
        procs.close()


def run_disaggregated(out: Path, rate: float) -> tuple[dict, dict]:
    procs = Processes(out / "logs-pd")
    kv_port, p_port, d_port, proxy_port = (free_port() for _ in range(4))
    prefill, decode, proxy = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, proxy_port))

    from protocol.curve import generate_keys

    keys = out / "keys"  # CurveZMQ to the service and a MAC on every block, as a deployment runs it
    generate_keys(keys, overwrite=True)

    def kv(role: str) -> str:
        return kv_transfer_config("ZmqConnector", role, kv_port, keys)

    try:
        procs.weft("kv-transfer", *kv_transfer_service_argv(kv_port, keys))
        for name, port, role in (("prefill", p_port, "kv_producer"), ("decode", d_port, "kv_consumer")):
            procs.weft(
                name,
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num-threads",
                "1",
                "--kv-transfer-config",
                kv(role),
                *ENGINE_ARGS,
            )
        procs.weft(
            "proxy",
            "pd-proxy",
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--host",
            "127.0.0.1",
            "--port",
            str(proxy_port),
        )
        procs.wait_healthy(proxy)
        report = bench_serve(proxy, rate, out / "pd.json")
        metrics = httpx.get(decode + "/metrics", timeout=10).text
        hits = sum(
            float(v)
            for v in re.findall(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.M)
        )
        return report, {"decode_external_prefix_cache_hits": hits, **transfer_log_stats(procs.log_dir)}
    finally:
        procs.close()


def transfer_log_stats(log_dir: Path) -> dict:
    """Blocks, MiB and ms of the engines' "KV saved/loaded" lines during the run."""
    stats = {}
    for name, verb in (("prefill", "saved"), ("decode", "loaded")):
        lines = re.findall(
            rf"KV {verb}: (\d+) blocks, ([\d.]+) MiB in ([\d.]+) ms",
            (log_dir / f"{name}.log").read_text(errors="replace"),
        )
        blocks = sum(int(b) for b, _, _ in lines)
        ms = sum(float(t) for _, _, t in lines)
        stats[f"{name}_{verb}"] = {
            "transfers": len(lines),
            "blocks": blocks,
            "mib": sum(float(m) for _, m, _ in lines),
            "ms_per_block": ms / blocks if blocks else 0.0,
        }
    return stats


def transfer_cost(num_blocks: int = 128) -> dict:
    """Save then load ``num_blocks`` blocks of the default model's shape, per store."""
    import torch

    from protocol.kv_transfer import KVBlockTransfer
    from services.kv_transfer.kv_blocks import PagedKVBlocks
    from services.kv_transfer.shared_storage import FileBlockStore
    from services.kv_transfer.transfer_thread import TransferThread
    from services.kv_transfer.zmq_connector import ZmqBlockStore
    from services.worker.layers.attention import kv_cache_shape

    torch.set_num_threads(1)
    shape = kv_cache_shape(num_blocks + 1, 16, 3, 64)  # SmolLM2-135M: 3 KV heads of 64, 30 layers

    def caches():
        return [torch.randn(shape) for _ in range(30)]

    ids, hashes = list(range(1, num_blocks + 1)), [i.to_bytes(32, "little") for i in range(num_blocks)]
    results = {}
    port = free_port()
    service = subprocess.Popen(
        # The transport alone (no CURVE), as before: what a block costs to move on loopback.
        [
            sys.executable,
            "-m",
            "services.cli",
            "kv-transfer",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--insecure-no-curve",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO_ROOT,
    )
    try:
        with tempfile.TemporaryDirectory() as folder:
            stores = {
                "zmq (weft kv-transfer, loopback tcp)": lambda: ZmqBlockStore(
                    f"tcp://127.0.0.1:{port}", timeout_s=60.0
                ),
                "shared storage (safetensors files)": lambda: FileBlockStore(folder),
            }
            for name, make in stores.items():
                producer = TransferThread(make(), PagedKVBlocks(caches()), lambda h: h)
                consumer = TransferThread(make(), PagedKVBlocks(caches()), lambda h: h)
                try:
                    start = time.perf_counter()
                    producer.submit("save", KVBlockTransfer("p", ids, hashes))
                    producer.take_finished(wait_s=120)
                    saved = time.perf_counter() - start
                    start = time.perf_counter()
                    consumer.submit("load", KVBlockTransfer("c", ids, hashes, wait_s=30))
                    _, loaded = consumer.take_finished(wait_s=120)
                    load_s = time.perf_counter() - start
                    assert loaded == {"c": num_blocks}, loaded
                    results[name] = {
                        "bytes_per_block": producer.blocks.block_nbytes,
                        "blocks": num_blocks,
                        "save_ms_per_block": saved * 1e3 / num_blocks,
                        "load_ms_per_block": load_s * 1e3 / num_blocks,
                    }
                finally:
                    producer.close()
                    consumer.close()
    finally:
        service.terminate()
        service.wait()
    return results


def summary(colocated: dict, pd: dict, pd_extra: dict, transfer: dict) -> str:
    rows = [
        "| | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | ITL p99 | output tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("colocated (1 engine, 2 threads)", colocated), ("P/D (proxy + prefill + decode)", pd)):
        t, i = r["ttft_ms"], r["itl_ms"]
        rows.append(
            f"| {name} | {t['median']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | {i['median']:.0f} | "
            f"{i['p90']:.0f} | {i['p99']:.0f} | {r['output_throughput']:.1f} |"
        )
    rows += ["", "| store | bytes per block | save ms/block | load ms/block |", "|---|---|---|---|"]
    for name, c in transfer.items():
        rows.append(
            f"| {name} | {c['bytes_per_block']:,} | {c['save_ms_per_block']:.2f} | "
            f"{c['load_ms_per_block']:.2f} |"
        )
    rows.append(f"\nduring the P/D run: {json.dumps(pd_extra)}")
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "pd")
    parser.add_argument("--skip-transfer-cost", action="store_true")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    args.out = args.out.resolve()  # the processes run in the repository root
    args.out.mkdir(parents=True, exist_ok=True)
    transfer = {} if args.skip_transfer_cost else transfer_cost()
    colocated = run_colocated(args.out, args.request_rate)
    pd, pd_extra = run_disaggregated(args.out, args.request_rate)
    (args.out / "summary.json").write_text(
        json.dumps(
            {
                "request_rate": args.request_rate,
                "engine_args": ENGINE_ARGS,
                "colocated": colocated,
                "pd": pd,
                "pd_transfers": pd_extra,
                "transfer_cost": transfer,
            },
            indent=2,
        )
        + "\n"
    )
    print(summary(colocated, pd, pd_extra, transfer))
    return 0
