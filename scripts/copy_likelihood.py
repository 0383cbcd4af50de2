"""What a dense copy's rounding costs: mean negative log likelihood of text, per setting.

    python scripts/copy_likelihood.py                       # fp32, bf16 copy, int8 copy
    python scripts/copy_likelihood.py --settings bf16 int8 --chars 6000 README.md docs/architecture.md

Each setting is one in-process engine (``LLM``) scoring the same texts with
prompt logprobs (the log likelihood of each token given the ones before),
all texts in one batched prefill, so every matmul runs the dense copy. The
first ``--chars`` characters of each file are scored; the figure is the mean
over all their tokens, in nats (lower is better), and its difference from the
first setting.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

SETTINGS = {
    "fp32": {"dtype": "float32"},
    # "model": the bf16 copy alone (dense_copy_dtype auto adds the int8 copy on some CPUs).
    "bf16": {"dtype": "bfloat16", "dense_copy_dtype": "model"},
    "int8": {"dense_copy_dtype": "int8"},
}
DEFAULT_FILES = ("README.md", "docs/architecture.md", "services/llm.py", "benchmarks/workloads/README.md")


def mean_nll(settings: dict, texts: list[str]) -> tuple[float, int]:
    from protocol import SamplingParams
    from services import LLM

    llm = LLM(enable_prefix_caching=False, **settings)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        total, count = 0.0, 0
        for out in llm.generate(texts, params, use_tqdm=False):
            for position, entry in enumerate(out.prompt_logprobs):
                if entry is not None:
                    total -= entry[out.prompt_token_ids[position]].logprob
                    count += 1
    finally:
        llm.shutdown()
    return total / count, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["fp32", "bf16", "int8"])
    parser.add_argument("--chars", type=int, default=6000, help="Characters scored from each file's start.")
    args = parser.parse_args()
    texts = [Path(f).read_text()[: args.chars] for f in args.files]
    first = None
    for name in args.settings:
        nll, count = mean_nll(SETTINGS[name], texts)
        first = nll if first is None else first
        print(
            f"{name:>5}: {nll:.4f} nats/token (perplexity {math.exp(nll):.2f}) over {count} tokens, "
            f"{nll - first:+.4f} against {args.settings[0]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
