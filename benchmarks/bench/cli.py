"""``weft bench``: benchmarks, one subcommand each.

Each subcommand is a ``Subcommand`` in ``SUBCOMMANDS``: a function that adds
its arguments and one that runs it. ``latency`` and ``serve`` join the table
when they exist; nothing here is heavier to import than argparse, so the
``weft`` command stays quick (torch loads only when a benchmark runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench import (
    executor_overhead,
    gpu,
    make_model,
    make_workload,
    pd,
    peers,
    serve_cli,
    throughput,
)
from benchmarks.bench import profile as profile_bench
from benchmarks.bench.dataset_args import add_dataset_arguments, load_dataset
from benchmarks.bench.throughput import BenchResult, warn_if_short
from benchmarks.bench.workload import Workload


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def _add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    from services.config.cli_args import add_engine_args

    add_dataset_arguments(parser)
    parser.add_argument(
        "--compare-hf",
        action="store_true",
        help="Also run Hugging Face generate (static batches, same dtype) and print weft/HF.",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16, help="Batch size of the HF baseline.")
    parser.add_argument(
        "--structured",
        choices=["json"],
        default=None,
        help="Run the workload unconstrained, then with every request constrained by one "
        "JSON schema, and compare (guided decoding's cost).",
    )
    parser.add_argument(
        "--compare-no-spec",
        action="store_true",
        help="With --speculative-config: run the workload without speculation too, and print "
        "the speed-up and the acceptance rate.",
    )
    parser.add_argument(
        "--output-json", type=Path, default=None, help="Also write the results to this JSON file."
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    add_engine_args(parser)  # --model, --dtype, --max-num-seqs, ... as `weft serve` takes them


def _run_throughput(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from services.config.cli_args import engine_args_from

    workload = load_dataset(args, parser)
    engine_args = engine_args_from(args)
    try:
        # Torch-free and quick: refuse bad engine arguments before loading anything.
        config = engine_args.create_engine_config()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if args.structured is not None:
        return _run_structured(args, workload, engine_args)
    if args.compare_no_spec:
        return _run_spec_comparison(args, workload, engine_args, parser)
    weft = throughput.run_weft(workload, use_tqdm=not args.quiet, **dataclasses.asdict(engine_args))
    warn_if_short(weft, workload)
    results = [weft]
    if args.compare_hf:
        gc.collect()  # let the engine's memory go before HF loads its own copy
        results.append(_run_hf(workload, args.model, weft.details, args.hf_batch_size))
    report = _report(workload, config.model.served_model_name, weft.details["dtype"], results)
    print(_table(workload, report))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _run_structured(args: argparse.Namespace, workload: Workload, engine_args) -> int:
    from benchmarks.bench.structured import run_structured, structured_table

    report = run_structured(workload, use_tqdm=not args.quiet, **dataclasses.asdict(engine_args))
    print(structured_table(workload, report))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _run_spec_comparison(
    args: argparse.Namespace, workload: Workload, engine_args, parser: argparse.ArgumentParser
) -> int:
    from benchmarks.bench.spec_decode import run_spec_comparison, spec_table

    if engine_args.speculative_config is None:
        parser.error("--compare-no-spec needs --speculative-config.")
    report = run_spec_comparison(workload, use_tqdm=not args.quiet, **dataclasses.asdict(engine_args))
    print(spec_table(workload, report))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _run_hf(workload: Workload, model: str | None, engine: dict[str, Any], batch_size: int) -> BenchResult:
    """The HF baseline on the engine's resolved dtype, device and CPU threads."""
    import torch

    from benchmarks.bench.hf_baseline import load_hf_model, run_hf_baseline

    torch.set_num_threads(engine["torch_threads"])
    hf_model = load_hf_model(model, engine["dtype"], engine["device"])
    return run_hf_baseline(workload, hf_model, batch_size)


def _report(workload: Workload, model: str, dtype: str, results: list[BenchResult]) -> dict[str, Any]:
    report: dict[str, Any] = {"workload": workload.name, "model": model, "dtype": dtype}
    report |= {result.backend: result.to_dict() for result in results}
    if len(results) == 2:
        weft, hf = results
        report["weft_over_hf_output_tokens_per_s"] = weft.output_tokens_per_s / hf.output_tokens_per_s
    return report


def _table(workload: Workload, report: dict[str, Any]) -> str:
    lines = [
        f"{workload.summary}; model {report['model']}, dtype {report['dtype']}",
        f"{'backend':<16}{'time (s)':>10}{'requests/s':>13}{'output tok/s':>15}{'total tok/s':>14}",
    ]
    for backend in ("weft", "hf"):
        if backend in report:
            r = report[backend]
            label = backend if backend == "weft" else f"hf (batch {r['details']['batch_size']})"
            lines.append(
                f"{label:<16}{r['elapsed_s']:>10.2f}{r['requests_per_s']:>13.2f}"
                f"{r['output_tokens_per_s']:>15.1f}{r['total_tokens_per_s']:>14.1f}"
            )
    if "weft_over_hf_output_tokens_per_s" in report:
        lines.append(f"weft / hf output tokens/s: {report['weft_over_hf_output_tokens_per_s']:.2f}x")
    return "\n".join(lines)


def _add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    from services.config.cli_args import add_engine_args

    parser.add_argument("--input-len", type=int, default=32, help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    parser.add_argument("--batch-size", type=int, default=8, help="Requests per batch.")
    parser.add_argument("--num-iters", type=int, default=10, help="Timed batches.")
    parser.add_argument("--num-iters-warmup", type=int, default=2, help="Untimed batches first.")
    parser.add_argument(
        "--output-json", type=Path, default=None, help="Also write the results to this JSON file."
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bars.")
    add_engine_args(parser)


def _run_latency(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from benchmarks.bench.latency import run_latency
    from services.config.cli_args import engine_args_from

    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.num_iters_warmup < 0:
        parser.error("--num-iters-warmup must be at least 0.")
    engine_args = engine_args_from(args)
    try:
        engine_args.create_engine_config()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    report = run_latency(
        args.input_len,
        args.output_len,
        args.batch_size,
        args.num_iters,
        args.num_iters_warmup,
        quiet=args.quiet,
        **dataclasses.asdict(engine_args),
    )
    lines = [
        f"batch {args.batch_size} x ({args.input_len} in, {args.output_len} out), "
        f"{args.num_iters} iterations, dtype {report['dtype']}",
        f"{'ms':<22}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    for key, label in (
        ("ttft_ms", "TTFT (prefill)"),
        ("decode_ms_per_token", "decode per token"),
        ("batch_latency_ms", "whole batch"),
    ):
        s = report[key]
        lines.append(f"{label:<22}{s['mean']:>9.2f}{s['median']:>9.2f}{s['p90']:>9.2f}{s['p99']:>9.2f}")
    print("\n".join(lines))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    from services.config.cli_args import add_engine_args

    add_dataset_arguments(parser)
    parser.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="Static batch sizes of the HF generate baseline.",
    )
    parser.add_argument(
        "--hf-bs1-requests",
        type=int,
        default=16,
        help="HF at batch size 1 runs only this many requests, spread evenly over the workload "
        "(its tok/s is a per-request rate; 0 = all of them).",
    )
    parser.add_argument(
        "--no-hf-continuous",
        dest="hf_continuous",
        action="store_false",
        help="Skip transformers' continuous batching.",
    )
    parser.add_argument(
        "--output-json", type=Path, default=None, help="Also write the results to this JSON file."
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    add_engine_args(parser)


def _run_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from benchmarks.bench.compare import format_compare, run_compare
    from services.config.cli_args import engine_args_from

    if min(args.hf_batch_sizes) < 1:
        parser.error("--hf-batch-sizes must be at least 1.")
    if args.hf_bs1_requests < 0:
        parser.error("--hf-bs1-requests must be 0 (all) or more.")
    workload = load_dataset(args, parser)
    engine_args = engine_args_from(args)
    try:
        engine_args.create_engine_config()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    kwargs = dataclasses.asdict(engine_args)
    model = kwargs.pop("model")
    report = run_compare(
        workload,
        model,
        args.hf_batch_sizes,
        args.hf_continuous,
        not args.quiet,
        bs1_requests=args.hf_bs1_requests or None,
        **kwargs,
    )
    print(format_compare(report))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "throughput": Subcommand(
        help="Offline throughput of weft's LLM.generate on a workload (optionally vs HF generate).",
        add_arguments=_add_throughput_arguments,
        run=_run_throughput,
    ),
    "latency": Subcommand(
        help="Offline latency of fixed-shape batches: TTFT (prefill) and decode time per token.",
        add_arguments=_add_latency_arguments,
        run=_run_latency,
    ),
    "compare": Subcommand(
        help="weft offline vs HF generate (static batches) and HF continuous batching, and step time vs pure forward.",
        add_arguments=_add_compare_arguments,
        run=_run_compare,
    ),
    "serve": Subcommand(
        help="Streaming client against an OpenAI-compatible server (--base-url), or, without it, "
        "a local `weft serve` compared with the offline engine.",
        add_arguments=serve_cli.add_arguments,
        run=serve_cli.run,
    ),
    "executor": Subcommand(
        help="Per-step round trip of the multi-process (tensor-parallel) executor vs the in-process one, "
        "with a model-free worker.",
        add_arguments=executor_overhead.add_arguments,
        run=executor_overhead.run,
    ),
    "peers": Subcommand(
        help="weft side by side with vLLM's CPU backend and llama.cpp's server (each in its own venv "
        "under .peers/), interleaved, offline and served; a table, JSON and PNG.",
        add_arguments=peers.add_arguments,
        run=peers.run,
    ),
    "profile": Subcommand(
        help="torch.profiler breakdown of decode-64, prefill-2048 and batch-1 decode steps, fused kernels off/on.",
        add_arguments=profile_bench.add_arguments,
        run=profile_bench.run,
    ),
    "pd": Subcommand(
        help="Disaggregated prefill/decode (pd-proxy, two servers, kv-transfer) vs one colocated server, "
        "with the pd-mixed workload; and the KV transfer cost per block.",
        add_arguments=pd.add_arguments,
        run=pd.run,
    ),
    "gpu": Subcommand(
        help="The GPU figures of scripts/gpu_check.sh: e2e, kernels or throughput (--smoke: tiny, on CPU).",
        add_arguments=gpu.add_arguments,
        run=gpu.run,
    ),
    "make-workload": Subcommand(
        help="Rebuild a generated workload file (pd-mixed, repetitive-8) in benchmarks/workloads.",
        add_arguments=make_workload.add_arguments,
        run=make_workload.run,
    ),
    "make-model": Subcommand(
        help="Write a GGUF with random weights in the shape of a real model (Llama 3.x, Qwen2.5, Qwen3) "
        "and the default model's tokenizer, for weft, llama.cpp and transformers alike.",
        add_arguments=make_model.add_arguments,
        run=make_model.run,
    ),
}


# Benchmarks that parse their own command line (the soak passes what it does
# not know on to `weft serve`); `weft bench NAME ...` hands them the rest.
def _soak_main(argv: list[str]) -> int:
    from benchmarks.bench.soak import main as soak_main

    return soak_main(argv)


OWN_PARSERS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "soak": ("Soak and chaos test of a `weft serve` stack it starts (weft bench soak --help).", _soak_main),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft bench", description="weft benchmarks.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="BENCHMARK")
    for name, subcommand in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=subcommand.help, description=subcommand.help)
        subcommand.add_arguments(sub)
        sub.set_defaults(subparser=sub)  # so a run reports bad input with its own usage
    for name, (text, _) in OWN_PARSERS.items():
        subparsers.add_parser(name, help=text, add_help=False)  # listed only; main() hands it argv
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``weft bench``; ``argv`` excludes ``weft bench`` itself."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_PARSERS:
        return OWN_PARSERS[argv[0]][1](argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return SUBCOMMANDS[args.command].run(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
