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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from services.bench import throughput
from services.bench.throughput import BenchResult
from services.bench.workload import Workload, load_workload, resolve_dataset


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def _add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    from services.cli_args import add_engine_args

    parser.add_argument("--dataset", required=True, help="Workload JSON file, or the name of one in $WEFT_WORKLOADS_DIR (e.g. offline-64).")
    parser.add_argument("--num-prompts", type=int, default=None, help="Run only the first N requests of the workload.")
    parser.add_argument("--compare-hf", action="store_true", help="Also run Hugging Face generate (static batches, same dtype) and print weft/HF.")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="Batch size of the HF baseline.")
    parser.add_argument("--output-json", type=Path, default=None, help="Also write the results to this JSON file.")
    add_engine_args(parser)  # --model, --dtype, --max-num-seqs, ... as `weft serve` takes them


def _run_throughput(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from services.cli_args import engine_args_from

    workload = _load(args, parser)
    engine_args = engine_args_from(args)
    try:
        # Torch-free and quick: refuse bad engine arguments before loading anything.
        config = engine_args.create_engine_config()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    weft = throughput.run_weft(workload, **dataclasses.asdict(engine_args))
    _warn_if_short(weft, workload)
    results = [weft]
    if args.compare_hf:
        gc.collect()  # let the engine's memory go before HF loads its own copy
        results.append(_run_hf(workload, args.model, weft.details, args.hf_batch_size))
    report = _report(workload, config.model.served_model_name, weft.details["dtype"], results)
    print(_table(workload, report))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _load(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Workload:
    for name in ("num_prompts", "hf_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    try:
        workload = load_workload(resolve_dataset(args.dataset))
    except ValueError as e:
        parser.error(str(e))
    return workload.head(args.num_prompts) if args.num_prompts else workload


def _run_hf(workload: Workload, model: str | None, engine: dict[str, Any], batch_size: int) -> BenchResult:
    """The HF baseline on the engine's resolved dtype, device and CPU threads."""
    import torch

    from services.bench.hf_baseline import load_hf_model, run_hf_baseline

    torch.set_num_threads(engine["torch_threads"])
    hf_model = load_hf_model(model, engine["dtype"], engine["device"])
    return run_hf_baseline(workload, hf_model, batch_size)


def _warn_if_short(result: BenchResult, workload: Workload) -> None:
    if result.output_tokens != workload.num_output_tokens:
        print(
            f"warning: {result.backend} produced {result.output_tokens} output tokens, "
            f"the workload asks for {workload.num_output_tokens}; its figures are off.",
            file=sys.stderr,
        )


def _report(workload: Workload, model: str, dtype: str, results: list[BenchResult]) -> dict[str, Any]:
    report: dict[str, Any] = {"workload": workload.name, "model": model, "dtype": dtype}
    report |= {result.backend: result.to_dict() for result in results}
    if len(results) == 2:
        weft, hf = results
        report["weft_over_hf_output_tokens_per_s"] = weft.output_tokens_per_s / hf.output_tokens_per_s
    return report


def _table(workload: Workload, report: dict[str, Any]) -> str:
    lines = [
        f"workload {workload.name}: {len(workload.requests)} requests, "
        f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens; "
        f"model {report['model']}, dtype {report['dtype']}",
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


SUBCOMMANDS: dict[str, Subcommand] = {
    "throughput": Subcommand(
        help="Offline throughput of weft's LLM.generate on a workload (optionally vs HF generate).",
        add_arguments=_add_throughput_arguments,
        run=_run_throughput,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft bench", description="weft benchmarks.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="BENCHMARK")
    for name, subcommand in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=subcommand.help, description=subcommand.help)
        subcommand.add_arguments(sub)
        sub.set_defaults(subparser=sub)  # so a run reports bad input with its own usage
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``weft bench``; ``argv`` excludes ``weft bench`` itself."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return SUBCOMMANDS[args.command].run(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
