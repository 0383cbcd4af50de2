"""``weft bench make-workload NAME``: rebuild one of the committed workloads.

``pd-mixed`` and ``repetitive-8`` are built from text in their modules,
tokenized with the default model's tokenizer; ``smoke-8``, ``offline-64``,
``shared-prefix-96``, ``short-16`` and ``long-2048`` are seeded draws of single-token words
(``make_random_workload``). The files are committed in ``benchmarks/workloads/``
so a benchmark never depends on a tokenizer run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.bench import make_pd_workload, make_random_workload, make_repetitive_workload
from benchmarks.bench.workload import workloads_dir

BUILDERS = {
    "pd-mixed": make_pd_workload.build,
    "repetitive-8": make_repetitive_workload.build,
    "smoke-8": make_random_workload.build_smoke,
    "offline-64": make_random_workload.build_offline,
    "shared-prefix-96": make_random_workload.build_shared_prefix,
    "short-16": make_random_workload.build_short,
    "long-2048": make_random_workload.build_long,
}
# The random-word files are written on one line, as they were first committed: with
# one token id per line they would be several times larger.
ONE_LINE = frozenset({"smoke-8", "offline-64", "shared-prefix-96", "short-16", "long-2048"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BUILDERS))
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="Folder to write NAME.json into (default: the workloads folder).",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from services.api.tokenizer import Tokenizer
    from services.model_files import resolve

    workload = BUILDERS[args.name](Tokenizer(resolve(None).hf_dir))
    out_dir = args.out_dir or workloads_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name}.json"
    text = json.dumps(workload) if args.name in ONE_LINE else json.dumps(workload, indent=1) + "\n"
    path.write_text(text)
    print(
        f"wrote {path}: {len(workload['requests'])} requests, {workload['total_prompt_tokens']} prompt and "
        f"{workload['total_output_tokens']} output tokens"
    )
    return 0
