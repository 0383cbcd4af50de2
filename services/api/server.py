"""``weft serve``: the API process, and the engine cores local to this node.

Builds the config once (torch-free), starts ``--data-parallel-size-local``
engine-core processes, and serves the Starlette app on uvicorn + uvloop.
Remote ranks are started on their nodes with ``engine-core --headless`` and
connect to ``--data-parallel-address``:``--data-parallel-rpc-port``.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from protocol.zmq_sockets import ipc_address, tcp_address
from services.cli_args import add_engine_args, engine_args_from

logger = logging.getLogger("weft.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft serve", description="Serve the OpenAI-compatible API.")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("WEFT_API_KEY"),
                        help="Require 'Authorization: Bearer KEY' on /v1 routes.")
    parser.add_argument("--data-parallel-size-local", type=int, default=None,
                        help="Engine cores to start on this node (default: all ranks).")
    parser.add_argument("--data-parallel-start-rank", type=int, default=0,
                        help="Rank of the first local engine core.")
    parser.add_argument("--data-parallel-address", default="127.0.0.1",
                        help="Address remote engine cores connect to.")
    parser.add_argument("--data-parallel-rpc-port", type=int, default=29550,
                        help="Handshake port for remote engine cores (0: any free port).")
    add_engine_args(parser)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_args_from(args).create_engine_config()
        local, handshake = _local_ranks_and_handshake(args, config.parallel.data_parallel_size)
    except (ValueError, FileNotFoundError, TypeError, OSError) as e:
        print(f"weft serve: {e}", file=sys.stderr)
        return 2
    return _run(args, config, local, handshake)


def _local_ranks_and_handshake(args: argparse.Namespace, size: int) -> tuple[int, str]:
    """How many engine cores start here, and the handshake address they (and
    remote ones) connect to."""
    local = size - args.data_parallel_start_rank if args.data_parallel_size_local is None \
        else args.data_parallel_size_local
    start = args.data_parallel_start_rank
    if not (0 <= start and 0 <= local and start + local <= size):
        raise ValueError(f"Local ranks {start}..{start + local - 1} do not fit in "
                         f"--data-parallel-size {size}.")
    if local == size:
        return local, ipc_address("handshake")  # every rank is on this node
    port = args.data_parallel_rpc_port
    if port == 0:
        # Local engines get the address on their command line, before the
        # client binds it: pick the free port now.
        port = _free_port(args.data_parallel_address)
    return local, tcp_address(args.data_parallel_address, port, bind=True)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _run(args: argparse.Namespace, config, local: int, handshake: str) -> int:
    import uvicorn

    from services.api.app import build_app
    from services.api.dp_client import DPLBEngineClient, launch_local_engines, stop_processes
    from services.api.tokenizer import Tokenizer

    # Engines take their torch thread count from the config (--num-threads).
    procs = launch_local_engines(local, args.data_parallel_start_rank, handshake)
    try:
        client = DPLBEngineClient(config, handshake, config.parallel.data_parallel_size, procs,
                                  local_start_rank=args.data_parallel_start_rank)
        app = build_app(client, Tokenizer(config.model.tokenizer), config, api_key=args.api_key,
                        served_model_name=config.model.served_model_name)
        uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", log_level="info")
    finally:
        # The app's shutdown already stopped them; this covers a failed start.
        stop_processes(procs, grace_s=5.0)
    return 0
