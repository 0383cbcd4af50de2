"""``engine-core --headless``: this node's engine cores, serving a remote API.

Starts ranks R..R+L-1 as ``python -m services.engine_core.proc`` processes
that shake hands with the API node at ``tcp://HOST:PORT``, and watches them:
when one exits, or on SIGTERM/SIGINT, all of them are stopped (SIGTERM: each
drains first, up to ``--shutdown-timeout``). Restarting this command later
brings the ranks back: they say hello again and the API routes to them once
they are ready. Torch-free itself; only the engine processes load it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading

from protocol.zmq_sockets import tcp_address
from services import config_file
from services.config.memory_plan import node_available_memory_or_none
from services.engine_core.proc_args import EngineCoreArgs, add_flags, flag_dest
from services.log_format import add_log_format_arg
from services.log_format import configure as configure_logging
from services.processes import STOP_GRACE_S, stop_processes

logger = logging.getLogger("engine-core")

_WATCH_S = 0.2
# The engine cores' own flags (services/engine_core/proc_args.py) this command passes on to each.
PASSED_ON = ("num_threads", "tensor_parallel_size", "curve_keys", "shutdown_timeout_s", "kv_transfer_config")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine-core", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--headless", action="store_true", required=True, help="Serve an API on another node (the only mode)."
    )
    parser.add_argument(
        "--dp-start-rank",
        "--data-parallel-start-rank",
        dest="start_rank",
        type=int,
        default=0,
        help="Rank of the first engine core on this node.",
    )
    parser.add_argument("--data-parallel-size", type=int, required=True, help="Engine cores in all.")
    parser.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="Engine cores on this node (default: all from the start rank).",
    )
    parser.add_argument("--data-parallel-address", required=True, help="Host of the API node.")
    parser.add_argument(
        "--data-parallel-rpc-port", type=int, required=True, help="Port of the API node's handshake socket."
    )
    add_flags(parser, PASSED_ON)
    add_log_format_arg(parser)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = config_file.parse_args(parser, argv)  # --config FILE.yaml and WEFT_* overrides too
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be non-negative, got {args.shutdown_timeout}.")
    if args.kv_transfer_config is not None:
        from services.config.kv_transfer_args import resolve_kv_transfer_config

        try:
            resolve_kv_transfer_config(args.kv_transfer_config)
        except ValueError as e:
            parser.error(str(e))
    if args.zmq_curve_keys is not None:
        from protocol.curve import CLIENT, load_keys

        try:
            load_keys(args.zmq_curve_keys, CLIENT)
        except ValueError as e:
            parser.error(str(e))
    if args.data_parallel_size_local is None:
        args.data_parallel_size_local = args.data_parallel_size - args.start_rank
    if args.start_rank < 0 or args.data_parallel_size_local < 1:
        parser.error("--dp-start-rank must be >= 0 and --data-parallel-size-local >= 1.")
    if args.start_rank + args.data_parallel_size_local > args.data_parallel_size:
        parser.error(
            f"Ranks {args.start_rank}..{args.start_rank + args.data_parallel_size_local - 1} "
            f"do not fit in --data-parallel-size {args.data_parallel_size}."
        )
    if not 1 <= args.data_parallel_rpc_port <= 65535:
        parser.error(f"--data-parallel-rpc-port must be in [1, 65535], got {args.data_parallel_rpc_port}.")
    return args


def engine_args(args: argparse.Namespace, rank: int, handshake_address: str) -> EngineCoreArgs:
    """The command line of engine core ``rank``, from this command's."""
    return EngineCoreArgs(
        rank=rank,
        handshake_address=handshake_address,
        headless=True,
        **{name: getattr(args, flag_dest(name)) for name in PASSED_ON},
        engines_on_node=args.data_parallel_size_local,
        available_memory=getattr(args, "available_memory", None),
        local_dp_rank=rank - args.start_rank,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_format, process="engine-core-launcher")  # its engine cores log the same way
    address = tcp_address(args.data_parallel_address, args.data_parallel_rpc_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ranks = range(args.start_rank, args.start_rank + args.data_parallel_size_local)
    # Measured once, before any of them loads, so that they all size their KV caches alike.
    args.available_memory = node_available_memory_or_none()
    processes = [subprocess.Popen(engine_args(args, rank, address).to_argv()) for rank in ranks]
    logger.info("Started engine cores %s for the API at %s", list(ranks), address)
    try:
        while not stop.wait(_WATCH_S):
            exited = [(rank, p.returncode) for rank, p in zip(ranks, processes) if p.poll() is not None]
            if exited:
                logger.info("Engine core(s) exited (rank, code): %s; stopping the others.", exited)
                break
    finally:
        stop_processes(processes, grace_s=args.shutdown_timeout + STOP_GRACE_S)
    codes = [p.returncode for p in processes]
    return 0 if stop.is_set() or all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
