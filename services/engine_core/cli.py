"""``engine-core --headless``: this node's engine cores, serving a remote API.

Starts ranks R..R+L-1 as ``python -m services.engine_core.proc`` processes
that shake hands with the API node at ``tcp://HOST:PORT``, and watches them:
when one exits, or on SIGTERM/SIGINT, all of them are stopped. Torch-free
itself; only the engine processes load it.
"""
from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading

from protocol.zmq_sockets import tcp_address

logger = logging.getLogger("engine-core")

_STOP_GRACE_S = 10.0
_WATCH_S = 0.2


def engine_command(rank: int, handshake_address: str, *, local: bool, headless: bool,
                   num_threads: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "services.engine_core.proc", "--rank", str(rank),
           "--handshake-address", handshake_address]
    if local:
        cmd.append("--local")
    if headless:
        cmd.append("--headless")
    if num_threads is not None:
        cmd += ["--num-threads", str(num_threads)]
    return cmd


def stop_processes(processes: list[subprocess.Popen], grace_s: float = _STOP_GRACE_S) -> None:
    """SIGTERM every process still running, then SIGKILL those that outlive ``grace_s``."""
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    for proc in processes:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("Engine process %d ignored SIGTERM; killing it.", proc.pid)
            proc.kill()
            proc.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="engine-core", description=__doc__.split("\n\n")[0])
    parser.add_argument("--headless", action="store_true", required=True,
                        help="Serve an API on another node (the only mode).")
    parser.add_argument("--dp-start-rank", "--data-parallel-start-rank", dest="start_rank", type=int,
                        default=0, help="Rank of the first engine core on this node.")
    parser.add_argument("--data-parallel-size", type=int, required=True, help="Engine cores in all.")
    parser.add_argument("--data-parallel-size-local", type=int, default=None,
                        help="Engine cores on this node (default: all from the start rank).")
    parser.add_argument("--data-parallel-address", required=True, help="Host of the API node.")
    parser.add_argument("--data-parallel-rpc-port", type=int, required=True,
                        help="Port of the API node's handshake socket.")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads per engine process.")
    args = parser.parse_args(argv)
    if args.data_parallel_size_local is None:
        args.data_parallel_size_local = args.data_parallel_size - args.start_rank
    if args.start_rank < 0 or args.data_parallel_size_local < 1:
        parser.error("--dp-start-rank must be >= 0 and --data-parallel-size-local >= 1.")
    if args.start_rank + args.data_parallel_size_local > args.data_parallel_size:
        parser.error(f"Ranks {args.start_rank}..{args.start_rank + args.data_parallel_size_local - 1} "
                     f"do not fit in --data-parallel-size {args.data_parallel_size}.")
    if not 1 <= args.data_parallel_rpc_port <= 65535:
        parser.error(f"--data-parallel-rpc-port must be in [1, 65535], got {args.data_parallel_rpc_port}.")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    address = tcp_address(args.data_parallel_address, args.data_parallel_rpc_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ranks = range(args.start_rank, args.start_rank + args.data_parallel_size_local)
    processes = [subprocess.Popen(engine_command(rank, address, local=False, headless=True,
                                                 num_threads=args.num_threads)) for rank in ranks]
    logger.info("Started engine cores %s for the API at %s", list(ranks), address)
    try:
        while not stop.wait(_WATCH_S):
            exited = [(rank, p.returncode) for rank, p in zip(ranks, processes) if p.poll() is not None]
            if exited:
                logger.info("Engine core(s) exited (rank, code): %s; stopping the others.", exited)
                break
    finally:
        stop_processes(processes)
    codes = [p.returncode for p in processes]
    return 0 if stop.is_set() or all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
