"""The dataset arguments every workload-driven benchmark takes, and the
workload they name."""

from __future__ import annotations

import argparse

from benchmarks.bench.datasets import default_tokenizer, load_any, random_workload
from benchmarks.bench.workload import Workload


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """A workload file, a ShareGPT file, or random prompts (one of them)."""
    parser.add_argument(
        "--dataset",
        default=None,
        help="A workload JSON file or the name of one in $WEFT_WORKLOADS_DIR (e.g. offline-64), "
        "or a ShareGPT-format JSON file (a list of conversations).",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="Run only the first N requests of the dataset; with --random-*, how many prompts.",
    )
    parser.add_argument(
        "--random-input-len", type=int, default=None, help="Random token prompts of this length."
    )
    parser.add_argument(
        "--random-output-len", type=int, default=None, help="Output length of the random prompts."
    )


def load_dataset(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Workload:
    """The workload the arguments name, or a usage error saying what is wrong."""
    for name in ("num_prompts", "hf_batch_size", "random_input_len", "random_output_len"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    is_random = args.random_input_len is not None or args.random_output_len is not None
    if (args.dataset is None) == (not is_random):
        parser.error("give either --dataset or --random-input-len, --random-output-len and --num-prompts.")
    try:
        if args.dataset is not None:
            return load_any(args.dataset, args.tokenizer, args.num_prompts)
        if None in (args.random_input_len, args.random_output_len, args.num_prompts):
            parser.error("random prompts need --random-input-len, --random-output-len and --num-prompts.")
        tokenizer = default_tokenizer(args.tokenizer)
        return random_workload(
            args.random_input_len,
            args.random_output_len,
            args.num_prompts,
            tokenizer.vocab_size,
            seed=args.seed,
            tokenizer=tokenizer,
        )
    except ValueError as e:
        parser.error(str(e))
