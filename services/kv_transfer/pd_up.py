"""``weft pd up``: disaggregated prefill/decode on one machine, in one command.

Starts the four processes the README's multi-machine commands start by hand,
secured as a deployment is: the ``weft kv-transfer`` service (CurveZMQ, keys
from a ``weft keys`` folder it makes), a prefill ``weft serve`` (kv_producer)
and a decode ``weft serve`` (kv_consumer), both sealing KV blocks with the
folder's MAC key, and ``weft pd-proxy`` in front, which alone holds the
generated secret the servers accept ``kv_transfer_params`` with. Every
internal port is a free loopback port; only the proxy listens on ``--host``.
Arguments it does not know go to both ``weft serve`` commands (``--model``,
engine flags). It stops them all on SIGTERM/SIGINT, or when any of them exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from protocol.curve import generate_keys
from services.ports import free_port
from services.processes import stop_processes

logger = logging.getLogger(__name__)
SECRET_FILE = "kv-transfer-secret"
_POLL_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weft pd up",
        allow_abbrev=False,  # an abbreviation must not take a flag meant for `weft serve`
        description=(
            "Disaggregated prefill/decode on this machine: the kv-transfer service, a prefill and a decode "
            "`weft serve` and the `weft pd-proxy` in front, with generated CURVE keys and proxy secret. "
            "Other arguments (--model, engine flags) go to both servers."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="The proxy's interface (default 127.0.0.1).")
    parser.add_argument(
        "--port", type=int, default=8000, help="The proxy's port, the one clients use (default 8000)."
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="Folder for the keys and the secret, kept across runs (default: a private temporary folder, "
        "removed on exit).",
    )
    parser.add_argument(
        "--connector",
        choices=("ZmqConnector", "SharedStorageConnector"),
        default="ZmqConnector",
        help="How KV blocks travel: through the kv-transfer service (default) or files under --dir.",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, help="Seconds to wait for both servers (default 900)."
    )
    return parser


def prepare_folder(folder: Path) -> Path:
    """A ``weft keys`` folder with the proxy's secret in it (each made once); returns the secret's path."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not (folder / "server.key").is_file():
        generate_keys(folder)
    secret = folder / SECRET_FILE
    if not secret.is_file():
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return secret


def kv_transfer_config(connector: str, role: str, kv_port: int, folder: Path) -> str:
    extra: dict = {"keys_dir": str(folder)}
    if connector == "SharedStorageConnector":
        extra["shared_storage_path"] = str(folder / "kv-store")
    config = {"kv_connector": connector, "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": kv_port}
    return json.dumps(config | {"kv_connector_extra_config": extra})


def kv_transfer_service_argv(kv_port: int, keys_dir: Path) -> list[str]:
    """The ``weft`` argv of a local kv_transfer service on ``kv_port``, CurveZMQ keys in ``keys_dir``."""
    return ["kv-transfer", "--host", "127.0.0.1", "--port", str(kv_port), "--zmq-curve-keys", str(keys_dir)]


def commands(
    args: argparse.Namespace, serve_args: list[str], folder: Path, secret: Path
) -> dict[str, list[str]]:
    """Name -> the ``weft`` argv of each process, in start order."""
    kv_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    out: dict[str, list[str]] = {}
    if args.connector == "ZmqConnector":
        out["kv-transfer"] = kv_transfer_service_argv(kv_port, folder)
    for name, role, port in (
        ("prefill", "kv_producer", prefill_port),
        ("decode", "kv_consumer", decode_port),
    ):
        out[name] = [
            "serve",
            *serve_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-transfer-config",
            kv_transfer_config(args.connector, role, kv_port, folder),
            "--kv-transfer-secret-file",
            str(secret),
        ]
    out["proxy"] = [
        "pd-proxy",
        "--prefill",
        f"http://127.0.0.1:{prefill_port}",
        "--decode",
        f"http://127.0.0.1:{decode_port}",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--kv-transfer-secret-file",
        str(secret),
    ]
    return out


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def run(args: argparse.Namespace, serve_args: list[str], folder: Path) -> int:
    secret = prepare_folder(folder)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name, argv in commands(args, serve_args, folder, secret).items():
            # Each in its own session: a Ctrl-C reaches this launcher, which stops them in order.
            processes[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *argv], start_new_session=True
            )
            if name != "proxy":
                print(f"weft pd up: {name}: {_url_of(argv)}", flush=True)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        proxy_url = f"http://{host}:{args.port}"
        deadline = time.monotonic() + args.startup_timeout
        ready = False
        while not stop.wait(_POLL_S):
            exited = {name: p.returncode for name, p in processes.items() if p.poll() is not None}
            if exited:
                logger.error("weft pd up: %s exited; stopping the others.", exited)
                return 1
            if not ready and _healthy(proxy_url):
                ready = True
                print(
                    f"weft pd up: ready: {proxy_url}/v1 (the proxy; keys and secret in {folder})", flush=True
                )
            if not ready and time.monotonic() > deadline:
                logger.error("weft pd up: not ready after %.0f s; stopping.", args.startup_timeout)
                return 1
        return 0
    finally:
        # The proxy first, so that no request starts on a server that is stopping.
        stop_processes(list(reversed(processes.values())))


def _url_of(argv: list[str]) -> str:
    port = argv[argv.index("--port") + 1]
    return f"tcp://127.0.0.1:{port}" if argv[0] == "kv-transfer" else f"http://127.0.0.1:{port}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "up":
        print("usage: weft pd up [--host H] [--port P] [--dir DIR] [SERVE ARGS...]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    args, serve_args = build_parser().parse_known_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.dir is not None:
        return run(args, serve_args, Path(args.dir))
    folder = Path(tempfile.mkdtemp(prefix="weft-pd-"))
    try:
        return run(args, serve_args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
