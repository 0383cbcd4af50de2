"""``weft bench serve``: its arguments and its two modes.

With ``--base-url``: the streaming client against that server, whatever it
is (weft, vLLM, a stub), with optional ``--sweep`` and plot. Without it: a
``weft serve`` started here with the engine arguments, compared with the
offline engine on the same workload (``serve.run_serve``); or, with
``--sweep``, that server alone swept over the values (a latency-throughput curve).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.bench.dataset_args import add_dataset_arguments, load_dataset
from benchmarks.bench.metrics import parse_goodput
from benchmarks.bench.serve_client import (
    ENDPOINTS,
    ClientConfig,
    format_report,
    plot_sweep,
    run_benchmark,
    served_model,
)
from benchmarks.bench.sweep import sweep_point, sweep_table
from services import env

SWEEPS = ("rates", "concurrencies")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.config.cli_args import add_engine_args

    add_dataset_arguments(parser)
    parser.add_argument(
        "--base-url",
        default=None,
        help="An OpenAI-compatible server, e.g. http://127.0.0.1:8000. Without it, a local "
        "`weft serve` is started with the engine arguments and compared with the offline engine.",
    )
    parser.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Requests per second, Poisson arrivals; inf (the default) sends all at once.",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Requests in flight at most (default: no limit; 64 for a local server).",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000.",
    )
    parser.add_argument(
        "--sweep",
        nargs="+",
        default=None,
        metavar="KIND VALUE",
        help="rates R1 R2 ... or concurrencies C1 C2 ...: one run per value, a table and a plot "
        "(without --base-url: through one `weft serve` started with the engine arguments).",
    )
    parser.add_argument("--plot", type=Path, default=None, help="Throughput-vs-latency PNG of a --sweep.")
    parser.add_argument(
        "--result-json",
        "--output-json",
        dest="output_json",
        type=Path,
        default=None,
        help="Also write the results to this JSON file.",
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    # --model is the model to request with --base-url (default: the server's first), else the one to serve.
    add_engine_args(parser, skip=("data_parallel_size",))  # one rank: the offline engine's setting


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    args.hf_batch_size = None  # load_dataset checks it; serve has no HF baseline
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1.")
    if args.request_rate <= 0:
        parser.error("--request-rate must be positive (inf sends everything at once).")
    try:
        slos = parse_goodput(args.goodput)
        sweep = _parse_sweep(args.sweep)
    except ValueError as e:
        parser.error(str(e))
    workload = load_dataset(args, parser)
    if args.base_url is None and sweep is not None:
        return _run_launched_sweep(args, parser, workload, slos, sweep)
    if args.base_url is None:
        return _run_launched(args, parser, workload, slos)
    base_url = args.base_url.rstrip("/")
    config = _client_config(args, base_url, args.model or _served_model(base_url, parser))
    if sweep is None:
        report = asyncio.run(run_benchmark(config, workload, slos))
        report["dataset"] = workload.name
        print(format_report(report))
    else:
        report = _run_sweep(config, workload, slos, *sweep, plot=args.plot or Path("bench-serve-sweep.png"))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _served_model(base_url: str, parser: argparse.ArgumentParser) -> str:
    import httpx

    try:
        return served_model(base_url)
    except (httpx.HTTPError, ValueError) as e:
        parser.error(f"cannot list the models of {base_url} ({e}); is the server up? Or pass --model.")


def _parse_sweep(items: list[str] | None) -> tuple[str, list[float]] | None:
    if items is None:
        return None
    if len(items) < 2 or items[0] not in SWEEPS:
        raise ValueError(f"--sweep takes {' or '.join(SWEEPS)} and then one or more values.")
    try:
        values = [float(v) for v in items[1:]]
    except ValueError:
        raise ValueError(f"--sweep values must be numbers (or inf), got {items[1:]}.") from None
    if any(v <= 0 for v in values) or (
        items[0] == "concurrencies" and any(not v.is_integer() for v in values)
    ):
        raise ValueError("--sweep values must be positive (whole numbers for concurrencies).")
    return items[0], values


def reset_prefix_cache(base_url: str, admin_key: str | None = None) -> bool:
    """POST /reset_prefix_cache (weft's and vLLM's route) with the server's admin key (``admin_key``,
    else the first of $WEFT_ADMIN_API_KEY); False where the server refuses or lacks it."""
    import httpx

    key = admin_key or next(iter((env.get("WEFT_ADMIN_API_KEY") or "").split(",")), "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        return httpx.post(base_url + "/reset_prefix_cache", headers=headers, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def _run_sweep(
    config: ClientConfig,
    workload: Any,
    slos: dict[str, float],
    kind: str,
    values: list[float],
    plot: Path,
    require_reset: bool = False,
    admin_key: str | None = None,
) -> dict[str, Any]:
    runs = []
    for value in values:
        # The points share one server: without a reset, the prompts a point sent
        # would be prefix hits for the next one, whose TTFT would then be a cache read.
        reset = reset_prefix_cache(config.base_url, admin_key=admin_key)
        if not reset and require_reset:
            raise RuntimeError(f"{config.base_url} did not reset its prefix cache before a sweep point.")
        if not reset:
            print(
                f"warning: {config.base_url}/reset_prefix_cache failed: this point may hit the "
                "prefixes the previous ones cached.",
                file=sys.stderr,
            )
        if kind == "rates":
            point = dataclasses.replace(config, request_rate=value)
        else:
            point = dataclasses.replace(config, max_concurrency=int(value))
        run = asyncio.run(run_benchmark(point, workload, slos))
        run["prefix_cache_reset"] = reset
        run["swept_value"] = (
            "inf" if math.isinf(value) else (int(value) if kind == "concurrencies" else value)
        )
        runs.append(run)
        print(
            f"--- {kind[:-1] if kind == 'rates' else 'concurrency'} {run['swept_value']} ---\n{format_report(run)}"
        )
    points = [sweep_point(run) for run in runs]
    print(sweep_table(kind, points))
    plot_sweep(runs, kind, str(plot))
    print(f"plot: {plot}")
    return {"dataset": workload.name, "sweep": kind, "plot": str(plot), "points": points, "runs": runs}


def _run_launched_sweep(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    workload: Any,
    slos: dict[str, float],
    sweep: tuple[str, list[float]],
) -> int:
    from benchmarks.bench.serve import launched_server
    from services.config.cli_args import engine_args_from

    engine_args = engine_args_from(args)
    try:
        model_name = engine_args.create_engine_config().model.served_model_name
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    with launched_server(engine_args, model_name, workload) as server:
        config = _client_config(args, server.url, model_name)
        report = _run_sweep(
            config,
            workload,
            slos,
            *sweep,
            plot=args.plot or Path("bench-serve-sweep.png"),
            require_reset=True,  # weft serve has the route: a refusal is a fault
            admin_key=getattr(server, "admin_key", None),
        )
    report["engine_args"] = {
        f.name: getattr(engine_args, f.name)
        for f in dataclasses.fields(engine_args)
        if getattr(engine_args, f.name) != f.default
    }
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _client_config(args: argparse.Namespace, base_url: str, model: str) -> ClientConfig:
    return ClientConfig(
        base_url=base_url,
        model=model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        quiet=args.quiet,
    )


def _run_launched(
    args: argparse.Namespace, parser: argparse.ArgumentParser, workload: Any, slos: dict[str, float]
) -> int:
    from benchmarks.bench import throughput
    from benchmarks.bench.serve import run_serve
    from services.config.cli_args import engine_args_from

    concurrency = args.max_concurrency or 64
    engine_args = engine_args_from(args)
    try:
        config = engine_args.create_engine_config()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    offline = throughput.run_weft(workload, use_tqdm=not args.quiet, **dataclasses.asdict(engine_args))
    throughput.warn_if_short(offline, workload)
    gc.collect()  # the offline engine's memory goes before the server loads its own
    served, metrics = run_serve(
        workload, engine_args, config.model.served_model_name, concurrency, quiet=args.quiet, slos=slos
    )
    ratio = served.output_tokens_per_s / offline.output_tokens_per_s
    report = {
        "workload": workload.name,
        "model": config.model.served_model_name,
        "dtype": offline.details["dtype"],
        "max_concurrency": concurrency,
        "weft": offline.to_dict(),
        "serve": served.to_dict(),
        "serve_metrics": metrics,
        "serve_over_offline_output_tokens_per_s": ratio,
    }
    print(
        f"{format_report(metrics)}\n"
        f"workload {workload.name}: {len(workload.requests)} requests, {workload.num_output_tokens} output tokens; "
        f"dtype {report['dtype']}, {concurrency} concurrent streams\n"
        f"offline LLM.generate: {offline.output_tokens_per_s:8.1f} output tok/s ({offline.elapsed_s:.2f} s)\n"
        f"weft serve (HTTP)   : {served.output_tokens_per_s:8.1f} output tok/s ({served.elapsed_s:.2f} s)\n"
        f"serve / offline: {ratio:.3f}; API process: {served.api_cores:.3f} cores"
    )
    if served.output_tokens != workload.num_output_tokens or metrics["failed"]:
        print(
            f"warning: the server produced {served.output_tokens} output tokens, the workload asks for "
            f"{workload.num_output_tokens}; failures: {metrics['errors']}",
            file=sys.stderr,
        )
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
