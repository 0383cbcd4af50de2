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
                        help="Handshake port for remote engine cores.")
    add_engine_args(parser)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_args_from(args).create_engine_config()
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"weft serve: {e}", file=sys.stderr)
        return 2
    size = config.parallel.data_parallel_size
    local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
    if not 0 <= local <= size:
        print(f"weft serve: --data-parallel-size-local must be in [0, {size}].", file=sys.stderr)
        return 2
    handshake = (ipc_address("handshake") if local == size
                 else tcp_address(args.data_parallel_address, args.data_parallel_rpc_port, bind=True))
    return _run(args, config, local, handshake)


def _run(args, config, local: int, handshake: str) -> int:
    import uvicorn

    from services.api.app import build_app
    from services.api.dp_client import DPLBEngineClient, launch_local_engines
    from services.api.tokenizer import Tokenizer

    threads = max(1, (os.cpu_count() or 1) // max(1, local))
    procs = launch_local_engines(local, args.data_parallel_start_rank, handshake, threads)
    client = DPLBEngineClient(config, handshake, config.parallel.data_parallel_size, procs)
    app = build_app(client, Tokenizer(config.model.tokenizer), config, api_key=args.api_key,
                    served_model_name=config.model.served_model_name)
    try:
        uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", log_level="info")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return 0
