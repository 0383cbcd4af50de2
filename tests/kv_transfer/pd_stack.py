"""A disaggregated prefill/decode stack of real processes on loopback, as the
docker-compose ``pd`` profile lays it out: a prefill ``weft serve``
(kv_producer), a decode ``weft serve`` (kv_consumer), ``weft pd-proxy`` in
front, and for the ZmqConnector the ``weft kv-transfer`` service. Secured as
a deployment should be: one ``weft keys`` folder (CurveZMQ to the service, a
keyed MAC on every block) and the proxy's secret (the servers accept
``kv_transfer_params`` from it only). Used by the
end-to-end tests; every process runs in its own session and is killed, with
its children, on close."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from protocol.curve import generate_keys
from services.kv_transfer import trust
from services.model_files import resolve
from services.ports import free_port
from tests.polling import wait_for, wait_healthy

MODEL = resolve(None)
STARTUP_DEADLINE_S = 300.0  # two model loads on two shared cores
ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--num-gpu-blocks-override",
    "128",
    "--block-size",
    "16",
    "--max-num-batched-tokens",
    "256",
    "--num-threads",
    "1",
]
# Short, so the tests of a dead service spend seconds, not minutes, in fallbacks.
TRANSFER_TIMEOUT_S = 2.0


def kv_transfer_config(connector: str, role: str, kv_port: int, storage: Path, keys: Path) -> dict:
    extra = {"timeout_s": TRANSFER_TIMEOUT_S, "keys_dir": str(keys)}
    if connector == "SharedStorageConnector":
        extra["shared_storage_path"] = str(storage)
    return {
        "kv_connector": connector,
        "kv_role": role,
        "kv_ip": "127.0.0.1",
        "kv_port": kv_port,
        "kv_connector_extra_config": extra,
    }


class PDStack:
    def __init__(self, connector: str, work_dir: Path, engine_args: list[str] = ENGINE_ARGS) -> None:
        self.connector = connector
        self.log_dir = work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.storage = work_dir / "kv-store"
        self.keys = work_dir / "keys"
        generate_keys(self.keys)
        self.secret = "pd-stack-secret"
        self.secret_file = work_dir / "kv-transfer-secret"
        self.secret_file.write_text(self.secret)
        self.secret_file.chmod(0o600)
        self.kv_port = free_port()
        self.processes: dict[str, subprocess.Popen] = {}
        self.engine_args = engine_args
        if connector == "ZmqConnector":
            self.start_kv_transfer()
        self.prefill_url = self._serve("prefill", "kv_producer")
        self.decode_url = self._serve("decode", "kv_consumer")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._start(
            "proxy",
            [
                "pd-proxy",
                "--prefill",
                self.prefill_url,
                "--decode",
                self.decode_url,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--kv-transfer-secret-file",
                str(self.secret_file),
            ],
        )

    def start_kv_transfer(self) -> None:
        """The kv_transfer service, on the port the servers' connectors know (again, after ``stop``)."""
        self._start(
            "kv-transfer",
            [
                "kv-transfer",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.kv_port),
                "--zmq-curve-keys",
                str(self.keys),
            ],
        )

    def _serve(self, name: str, role: str) -> str:
        port = free_port()
        config = kv_transfer_config(self.connector, role, self.kv_port, self.storage, self.keys)
        self._start(
            name,
            [
                "serve",
                "--model",
                str(MODEL.weights),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--kv-transfer-config",
                json.dumps(config),
                "--kv-transfer-secret-file",
                str(self.secret_file),
                *self.engine_args,
            ],
        )
        return f"http://127.0.0.1:{port}"

    def _start(self, name: str, weft_argv: list[str]) -> None:
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        with open(self.log_dir / f"{name}.log", "wb") as log:  # the child keeps it open
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *weft_argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def wait_healthy(self) -> None:
        """Until the proxy reports both servers healthy (polling, with a deadline)."""

        def alive() -> None:
            exited = [name for name, p in self.processes.items() if p.poll() is not None]
            assert not exited, f"{exited} exited during start-up:\n{self.logs()}"

        wait_healthy(self.url, STARTUP_DEADLINE_S, alive, self.logs)

    def stop(self, name: str) -> None:
        proc = self.processes[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def close(self) -> None:
        for name in self.processes:
            self.stop(name)

    # ---- what the servers say

    @property
    def trusted(self) -> dict[str, str]:
        """The header that lets a test talk to the servers as the proxy does."""
        return {trust.HEADER: self.secret}

    def ranks(self, url: str) -> list[dict]:
        return httpx.get(url + "/health", timeout=10).json()["ranks"]

    def wait_until_idle(self, deadline_s: float = 30.0) -> None:
        """Both servers run nothing and have every KV block free (producers free after the save)."""

        def idle() -> bool:
            ranks = [r for url in (self.prefill_url, self.decode_url) for r in self.ranks(url)]
            return all(
                r["num_running"] == 0
                and r["num_waiting"] == 0
                and r["num_free_blocks"] == r["num_blocks"] - 1
                for r in ranks
            )

        try:
            wait_for(idle, deadline_s, "both servers idle with every KV block free")
        except AssertionError as e:
            raise AssertionError(
                f"{e}: {[self.ranks(u) for u in (self.prefill_url, self.decode_url)]}"
            ) from None

    def counter(self, url: str, name: str) -> float:
        """A counter of a server's /metrics, summed over its labels."""
        text = httpx.get(url + "/metrics", timeout=10).text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))
