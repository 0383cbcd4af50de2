"""``weft serve``: the API process, and the engine cores local to this node.

Builds the config once (torch-free), starts ``--data-parallel-size-local``
engine-core processes (restarted with back-off if they die), and serves the
Starlette app on uvicorn + uvloop until SIGTERM/SIGINT, then drains
(``services.api.graceful``). Remote ranks are started on their nodes with
``engine-core --headless`` and connect to
``--data-parallel-address``:``--data-parallel-rpc-port``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Any

from protocol import EngineConfig
from protocol.curve import CLIENT, SERVER, CurveKeys, load_keys
from protocol.zmq_sockets import ipc_address, tcp_address
from services import config_file, env
from services.api.api_options import add_api_option_args, api_options
from services.api.chat_args import ChatSettings, add_chat_args, chat_settings_from
from services.api.engine_client import DEFAULT_STEP_TIMEOUT_S
from services.api.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_STOP,
    DEFAULT_MAX_STOP_BYTES,
    DEFAULT_MAX_STOP_TOKEN_IDS,
    DEFAULT_MAX_TOOLS,
    DEFAULT_MAX_WAITING_REQUESTS,
    ServingLimits,
    add_cost_args,
    available_memory_bytes,
)
from services.api.management import add_admin_args, admin_api_keys
from services.api.operator_options import OperatorOptions, add_operator_args, operator_options, tls_options
from services.api.responses_store import ResponsesStore, add_responses_store_args, responses_store_from
from services.config.cli_args import add_engine_args, engine_args_from
from services.config.memory_plan import with_node_memory
from services.kv_transfer.trust import add_secret_arg as add_kv_transfer_secret_arg
from services.kv_transfer.trust import load_secret as load_kv_transfer_secret
from services.log_format import configure as configure_logging
from services.ports import free_port
from services.processes import DEFAULT_SHUTDOWN_TIMEOUT_S

if TYPE_CHECKING:
    from services.api.prefix_router import PrefixRouter

logger = logging.getLogger("weft.serve")

# uvicorn's own keep-alive default; a cap on connections it lacks (None: unbounded).
DEFAULT_KEEP_ALIVE_S = 5.0
DEFAULT_MAX_CONNECTIONS = 2048


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft serve", description="Serve the OpenAI-compatible API.")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="Require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize; "
        "repeat to accept several keys "
        "(default: $WEFT_API_KEY, comma-separated). A key here shows in `ps`: "
        "prefer --api-key-file or the environment variable.",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="Read the API keys from this file, one per line (#-comments allowed).",
    )
    parser.add_argument(
        "--api-key-protects-tokenize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With an API key, require it on /tokenize and /detokenize too.",
    )
    add_admin_args(parser.add_argument_group("administration"))
    _add_hardening_args(parser)
    add_chat_args(parser)
    add_responses_store_args(parser)
    add_api_option_args(parser)
    add_operator_args(parser)
    parser.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="Engine cores to start on this node (default: all ranks).",
    )
    parser.add_argument(
        "--data-parallel-start-rank", type=int, default=0, help="Rank of the first local engine core."
    )
    parser.add_argument(
        "--data-parallel-address", default="127.0.0.1", help="Address remote engine cores connect to."
    )
    parser.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=29550,
        help="Handshake port for remote engine cores (0: any free port).",
    )
    _add_routing_args(parser)
    parser.add_argument(
        "--data-parallel-input-port",
        type=int,
        default=None,
        help="Port of the request socket remote engine cores connect to "
        "(default: the rpc port + 1; 0: any free port).",
    )
    parser.add_argument(
        "--data-parallel-output-port",
        type=int,
        default=None,
        help="Port of the output socket remote engine cores connect to "
        "(default: the rpc port + 2; 0: any free port).",
    )
    add_engine_args(parser)
    return parser


def _add_hardening_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reliability and security")
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="Engine requests that may wait per ready engine core beyond the max-num-seqs it runs, "
        "queued in the engine; more get 503 with Retry-After. One waiting request holds at most its "
        "body (--max-request-body-bytes), its prompt text at 4 bytes a character (--max-prompt-chars) "
        "and 128 bytes a prompt token (--max-prompt-tokens): 8 MiB + 1 MiB for an 8,192-token model "
        f"with the default limits (default: {DEFAULT_MAX_WAITING_REQUESTS}, lowered to what fits in "
        "half the memory available at start, for every engine core).",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="Abort a request still running after this many seconds (504; default: none).",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="On SIGTERM, seconds in-flight requests may run before they are ended with an error "
        "(default: %(default)g).",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="Largest request body accepted (413 beyond).",
    )
    group.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="Most choices (n) per request.")
    group.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="Largest max_tokens a request may ask for (default: up to max-model-len).",
    )
    group.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="Longest prompt in tokens (default: max-model-len - 1).",
    )
    group.add_argument(
        "--zmq-curve-keys",
        default=None,
        metavar="DIR",
        help="Authenticate and encrypt the links to the engine cores with CurveZMQ, using the "
        "keys `weft keys --dir DIR` made (give engine-core the same folder).",
    )
    add_kv_transfer_secret_arg(group)
    group.add_argument(
        "--restart-engines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Restart a local engine core that dies (with back-off).",
    )
    group.add_argument(
        "--step-timeout",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        metavar="SECONDS",
        help="An engine core whose current step has run longer is hung (a stuck worker or "
        "tensor-parallel collective): its requests fail with a 500 and a local one is killed and "
        "restarted (default: %(default)g).",
    )
    _add_request_size_args(group)


def _add_request_size_args(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--max-prompts",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        help="Most prompts in one completions request (400 beyond, before tokenizing).",
    )
    group.add_argument(
        "--max-prompt-chars",
        type=int,
        default=DEFAULT_MAX_PROMPT_CHARS,
        help="Most characters of prompt or message text per request (400, before tokenizing).",
    )
    group.add_argument(
        "--max-messages",
        type=int,
        default=DEFAULT_MAX_MESSAGES,
        help="Most chat messages per request (400 beyond, before the chat template runs).",
    )
    group.add_argument(
        "--max-tools",
        type=int,
        default=DEFAULT_MAX_TOOLS,
        help="Most tools per chat or Responses request (400 beyond; default: %(default)s).",
    )
    group.add_argument(
        "--max-stop", type=int, default=DEFAULT_MAX_STOP, help="Most stop strings per request."
    )
    group.add_argument(
        "--max-stop-bytes",
        type=int,
        default=DEFAULT_MAX_STOP_BYTES,
        help="Most UTF-8 bytes of all stop strings of a request together.",
    )
    group.add_argument(
        "--max-stop-token-ids",
        type=int,
        default=DEFAULT_MAX_STOP_TOKEN_IDS,
        help="Most stop_token_ids per request.",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="Seconds a request's headers, then its body, may take to arrive "
        "(beyond: the connection is closed; 408 for a body).",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="Most connections and tasks served at once; more get 503 at once (uvicorn's limit_concurrency).",
    )
    group.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=DEFAULT_KEEP_ALIVE_S,
        help="Seconds an idle keep-alive connection stays open.",
    )
    add_cost_args(group)


def _add_routing_args(parser: argparse.ArgumentParser) -> None:
    from services.api.prefix_router import DEFAULT_MAX_IMBALANCE, ROUTING_MODES

    group = parser.add_argument_group("data-parallel routing")
    group.add_argument(
        "--dp-routing",
        choices=ROUTING_MODES,
        default=None,
        help="prefix: by the longest prefix each rank caches (from its KV cache events), within "
        "--dp-prefix-max-imbalance of the least loaded rank; load: by 4 x waiting + running "
        "alone (default: prefix when --kv-events-config publishes, else load).",
    )
    group.add_argument(
        "--dp-prefix-max-imbalance",
        type=int,
        default=DEFAULT_MAX_IMBALANCE,
        help="Prefix routing: a rank more than this many load units (4 per waiting request, 1 per "
        "running one) above the least loaded rank gets no request for its cached prefix.",
    )


def prefix_router_for(args: argparse.Namespace, config: EngineConfig) -> PrefixRouter | None:
    """The balancer's PrefixRouter, or None for load-only routing."""
    from protocol.kv_events import check_endpoints
    from services.api.prefix_router import PrefixRouter

    events = config.kv_events
    events_on = events is not None and events.publishes
    if (
        events is not None and events_on
    ):  # an endpoint other hosts reach needs CURVE: refused before any engine starts
        check_endpoints(events, config.parallel.data_parallel_size, has_keys=args.zmq_curve_keys is not None)
    routing = args.dp_routing or ("prefix" if events_on else "load")
    if routing == "load":
        return None
    return PrefixRouter(config, max_imbalance=args.dp_prefix_max_imbalance)


def serving_limits(args: argparse.Namespace, config: EngineConfig | None = None) -> ServingLimits:
    """The limits the flags set; with the engine ``config``, --max-waiting-requests' default resolved
    against the memory available now."""
    limits = _limits_from(args)
    if config is None or limits.max_waiting_requests is not None:
        return limits
    waiting = limits.fitting_waiting_requests(
        config.model.max_model_len, config.parallel.data_parallel_size, available_memory_bytes()
    )
    if waiting < DEFAULT_MAX_WAITING_REQUESTS:
        logger.warning(
            "--max-waiting-requests defaults to %d per engine core: %d waiting requests of up to %.1f MiB "
            "each would not fit in half the memory available.",
            waiting,
            DEFAULT_MAX_WAITING_REQUESTS,
            limits.waiting_request_bytes(config.model.max_model_len) / 2**20,
        )
    return dataclasses.replace(limits, max_waiting_requests=waiting)


def _limits_from(args: argparse.Namespace) -> ServingLimits:
    return ServingLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_n=args.max_n,
        max_tokens=args.max_tokens_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        max_prompts=args.max_prompts,
        max_prompt_chars=args.max_prompt_chars,
        max_stop=args.max_stop,
        max_stop_bytes=args.max_stop_bytes,
        max_stop_token_ids=args.max_stop_token_ids,
        body_timeout_s=args.body_timeout,
        max_messages=args.max_messages,
        max_tools=args.max_tools,
        pause_hold_timeout_s=args.pause_hold_timeout or None,
        max_prompt_logprob_entries=args.max_prompt_logprob_entries,
    )


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key and --api-key-file together; only without either, $WEFT_API_KEY."""
    keys = list(args.api_key or [])
    if args.api_key_file is not None:
        keys += _keys_in_file(args.api_key_file)
    if args.api_key or args.api_key_file is not None:
        return keys
    return [key for key in (env.get("WEFT_API_KEY") or "").split(",") if key]


def _keys_in_file(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        keys = [line.strip() for line in f]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key.")
    return keys


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """Connection limits for uvicorn.Config (the body timeout is checked by ServingLimits)."""
    from services.api.slow_clients import header_deadline_protocol  # uvicorn: only once serving

    if args.max_connections < 1 or not args.keep_alive_timeout > 0:
        raise ValueError("--max-connections must be at least 1 and --keep-alive-timeout positive.")
    return {
        "limit_concurrency": args.max_connections,
        "timeout_keep_alive": args.keep_alive_timeout,
        "http": header_deadline_protocol(args.body_timeout),
    }


def main(argv: list[str]) -> int:
    args = config_file.parse_args(build_parser(), argv)  # --config FILE.yaml and WEFT_* overrides too
    log_format = configure_logging(args.log_format, process="api")  # and the engine cores started here
    try:
        operator = operator_options(args)
        config = engine_args_from(args).create_engine_config(device_in_engine=True)
        local, handshake = _local_ranks_and_handshake(args, config.parallel.data_parallel_size)
        if local:
            config = with_node_memory(config, local, config.cache.available_memory)  # they share this node
        ports = data_ports(args)
        limits = serving_limits(args, config)
        chat = chat_settings_from(args)
        store = responses_store_from(args)
        prefix_router_for(args, config)  # refuse prefix routing without events before starting engines
        curve = load_keys(args.zmq_curve_keys, SERVER) if args.zmq_curve_keys is not None else None
        if args.zmq_curve_keys is not None and local:
            load_keys(args.zmq_curve_keys, CLIENT)  # the local engines' keys
        if any(not key for key in args.api_key or ()):
            raise ValueError("--api-key must not be empty.")
        if not args.step_timeout > 0:
            raise ValueError(f"--step-timeout must be positive, got {args.step_timeout:g}.")
        keys = api_keys(args)
        admin_keys = admin_api_keys(args)
        server_options = uvicorn_options(args) | tls_options(args)
        if log_format == "json":
            server_options["log_config"] = None  # uvicorn's lines go through the root logger's JSON
        args.kv_transfer_secret = load_kv_transfer_secret(args.kv_transfer_secret_file)
    except (ValueError, FileNotFoundError, TypeError, OSError) as e:
        print(f"weft serve: {e}", file=sys.stderr)
        return 2
    args.admin_keys = admin_keys
    return _run(
        args, config, local, handshake, limits, curve, chat, keys, server_options, ports, store, operator
    )


def _local_ranks_and_handshake(args: argparse.Namespace, size: int) -> tuple[int, str]:
    """How many engine cores start here, and the handshake address they (and
    remote ones) connect to."""
    local = (
        size - args.data_parallel_start_rank
        if args.data_parallel_size_local is None
        else args.data_parallel_size_local
    )
    start = args.data_parallel_start_rank
    if not (0 <= start and 0 <= local and start + local <= size):
        raise ValueError(
            f"Local ranks {start}..{start + local - 1} do not fit in --data-parallel-size {size}."
        )
    if local == size:
        return local, ipc_address("handshake")  # every rank is on this node
    port = args.data_parallel_rpc_port
    if port == 0:
        # Local engines get the address on their command line, before the
        # client binds it: pick the free port now.
        port = free_port(args.data_parallel_address)
    return local, tcp_address(args.data_parallel_address, port, bind=True)


def data_ports(args: argparse.Namespace) -> tuple[int, int]:
    """The TCP ports of the request and output sockets, for remote ranks: fixed, so that a
    firewall can let them through (the rpc port + 1 and + 2 unless given; 0: any free port)."""
    rpc = args.data_parallel_rpc_port
    input_port, output_port = (
        given if given is not None else (rpc + offset if rpc else 0)
        for given, offset in ((args.data_parallel_input_port, 1), (args.data_parallel_output_port, 2))
    )
    ports = (input_port, output_port)
    for name, port in zip(("input", "output"), ports, strict=True):
        if not 0 <= port <= 65535:
            raise ValueError(f"--data-parallel-{name}-port must be in [0, 65535], got {port}.")
    fixed = [port for port in (rpc, *ports) if port]
    if len(set(fixed)) != len(fixed):
        raise ValueError(
            f"--data-parallel-rpc-port, -input-port and -output-port must differ, got {rpc}, "
            f"{ports[0]} and {ports[1]}."
        )
    return ports


def _run(
    args: argparse.Namespace,
    config: EngineConfig,
    local: int,
    handshake: str,
    limits: ServingLimits,
    curve: CurveKeys | None,
    chat: ChatSettings,
    keys: list[str],
    server_options: dict[str, Any],
    ports: tuple[int, int] = (0, 0),
    store: ResponsesStore | None = None,
    operator: OperatorOptions | None = None,
) -> int:
    from services.api.app import build_app
    from services.api.dp_client import DPLBEngineClient, launch_local_engines, stop_processes
    from services.api.graceful import serve
    from services.api.tokenizer import Tokenizer

    # Engines take their torch thread count from the config (--num-threads).
    procs = launch_local_engines(
        local,
        args.data_parallel_start_rank,
        handshake,
        curve_keys=args.zmq_curve_keys,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    client = None
    try:
        client = DPLBEngineClient(
            config,
            handshake,
            config.parallel.data_parallel_size,
            procs,
            local_start_rank=args.data_parallel_start_rank,
            curve=curve,
            restart_local=args.restart_engines,
            step_timeout_s=args.step_timeout,
            prefix_router=prefix_router_for(args, config),
            data_ports=ports,
        )
        app = build_app(
            client,
            Tokenizer(config.model.tokenizer),
            config,
            api_key=keys,
            served_model_name=args.served_model_name or config.model.served_model_name,
            limits=limits,
            chat=chat,
            protect_tokenize=args.api_key_protects_tokenize,
            options=api_options(args),
            kv_transfer_secret=args.kv_transfer_secret,
            responses_store=store,
            operator=operator,
            admin_api_key=args.admin_keys,
        )
        serve(app, host=args.host, port=args.port, shutdown_timeout_s=args.shutdown_timeout, **server_options)
    finally:
        # The app's shutdown already stopped them (restarted ones included);
        # this covers a failed start.
        stop_processes(list(client.local.processes.values()) if client else procs, grace_s=5.0)
    if client.start_failure is not None:
        print(f"weft serve: {client.start_failure}", file=sys.stderr)
        return 1
    return 0
