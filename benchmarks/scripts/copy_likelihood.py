"""What a dense copy's (or the KV cache's) rounding costs: mean negative log likelihood of text, per setting.

    python benchmarks/scripts/copy_likelihood.py --settings dequantized packed packed-int16   # the packed default
    python benchmarks/scripts/copy_likelihood.py                       # fp32, bf16 copy, int8 copy
    python benchmarks/scripts/copy_likelihood.py --settings bf16 int8 --chars 6000 README.md docs/architecture.md
    python benchmarks/scripts/copy_likelihood.py --settings bf16 int8-kv --greedy 128   # the int8 KV cache
    python benchmarks/scripts/copy_likelihood.py --settings int8 int8-a7 int8-a6   # 7- and 6-bit activations

Each setting is one in-process engine (``LLM``) scoring the same texts with
prompt logprobs (the log likelihood of each token given the ones before),
all texts in one batched prefill, so every matmul runs the dense copy. The
first ``--chars`` characters of each file are scored; the figure is the mean
over all their tokens, in nats (lower is better), and its difference from the
first setting. Prompt logprobs come from prefill steps only; ``--greedy N`` also continues the
first 200 tokens of each text greedily for N tokens (decode steps, where the int8 KV cache's
decode kernel runs) and counts, against the first setting, the tokens before the first one
that differs.

``int8-a7`` and ``int8-a6`` are not weft settings but an emulation of what rounding a batched
step's activations to 7 (6) bits instead of 8 would cost: the int8 copy's ``linear`` replaced,
for steps of 8 rows and more, by its torch twins with rows rounded to +-63 (+-31) rather than
+-127. A 7-bit x made unsigned (x + 64) would spare AVX2's int8 GEMM its sign instructions
(``benchmarks/scripts/vector_ops_bench.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path

SETTINGS = {
    # The GGUF dequantized to fp32 at load: the oracle the packed default is held to (+0.01 nats).
    "dequantized": {"dtype": "float32", "quantization": "none", "kv_cache_dtype": "model"},
    # The defaults: packed weights alone, activations rounded to int8 per group (or int16, opt-in).
    "packed": {"kv_cache_dtype": "model"},
    "packed-int8": {"kv_cache_dtype": "model", "activations": "int8"},
    "packed-int16": {"kv_cache_dtype": "model", "activations": "int16"},
    "fp32": {"dtype": "float32"},
    # "model": the bf16 copy alone (dense_copy_dtype auto adds the int8 copy on some CPUs), and the
    # KV cache in bf16 (kv_cache_dtype auto makes it int8 on CPU).
    "bf16": {"dtype": "bfloat16", "dense_copy_dtype": "model", "kv_cache_dtype": "model"},
    "int8": {"dense_copy_dtype": "int8", "kv_cache_dtype": "model"},
    # fp32 weights with no int8 copy (dense_copy_dtype auto adds one on AVX2 alone).
    "fp32-dense": {"dtype": "float32", "dense_copy_dtype": "model", "kv_cache_dtype": "model"},
    "int8-kv": {"dtype": "bfloat16", "dense_copy_dtype": "model", "kv_cache_dtype": "int8"},
    "int8-a7": {"dense_copy_dtype": "int8", "kv_cache_dtype": "model", "activation_levels": 63},
    "int8-a6": {"dense_copy_dtype": "int8", "kv_cache_dtype": "model", "activation_levels": 31},
}


DEFAULT_FILES = ("README.md", "docs/architecture.md", "services/llm.py", "benchmarks/workloads/README.md")


@contextlib.contextmanager
def activations_rounded_to(levels: int | None):
    """The int8 copy's batched steps (8 rows and more) with x's rows rounded to +-levels (None:
    as weft rounds them), in this process's engine."""
    from services.worker.layers.int8_linear import Int8Weight

    if levels is None:
        yield
        return
    import torch

    from kernels.reference import hadamard_rows_ref

    weft_linear = Int8Weight.linear

    def linear(self, x, bias):
        rows = x.reshape(-1, x.shape[-1]).float()
        if rows.shape[0] < 8:
            return weft_linear(self, x, bias)
        if self.hadamard_block:
            rows = hadamard_rows_ref(rows, self.hadamard_block)
        amax = rows.abs().amax(-1)
        inv = (levels / amax).clamp(max=torch.finfo(torch.float32).max)
        q = torch.round(rows * inv[:, None]).clamp(-levels, levels).to(torch.int8)
        out = self.integer_product(q).float() * (amax / levels)[:, None] * self.scale[None, :]
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    Int8Weight.linear = linear
    try:
        yield
    finally:
        Int8Weight.linear = weft_linear


def mean_nll(settings: dict, texts: list[str], greedy: int = 0) -> tuple[float, int, list[list[int]]]:
    """The mean NLL over the texts' tokens, their count, and (``greedy`` > 0) each text's greedy
    continuation of its first 200 tokens."""
    from services import LLM
    from services.worker.layers.quantized_linear import activations_from_env, choose_kernel

    settings = dict(settings)
    levels = settings.pop("activation_levels", None)
    choose_kernel(None, settings.pop("activations", activations_from_env()))
    with activations_rounded_to(levels):
        return _mean_nll(LLM(enable_prefix_caching=False, **settings), texts, greedy)


def _mean_nll(llm, texts: list[str], greedy: int) -> tuple[float, int, list[list[int]]]:
    from protocol import SamplingParams

    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        total, count = 0.0, 0
        prompts = []
        for out in llm.generate(texts, params, use_tqdm=False):
            prompts.append(out.prompt_token_ids[:200])
            for position, entry in enumerate(out.prompt_logprobs):
                if entry is not None:
                    total -= entry[out.prompt_token_ids[position]].logprob
                    count += 1
        continuations = []
        if greedy:
            params = SamplingParams(temperature=0.0, max_tokens=greedy, ignore_eos=True)
            continuations = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    return total / count, count, continuations


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["fp32", "bf16", "int8"])
    parser.add_argument("--chars", type=int, default=6000, help="Characters scored from each file's start.")
    parser.add_argument("--greedy", type=int, default=0, help="Greedy tokens to continue each text with.")
    args = parser.parse_args()
    texts = [Path(f).read_text()[: args.chars] for f in args.files]
    first = first_tokens = None
    for name in args.settings:
        nll, count, tokens = mean_nll(SETTINGS[name], texts, args.greedy)
        if first is None:
            first, first_tokens = nll, tokens
        agree = ""
        if args.greedy:
            prefixes = [agreeing_prefix(a, b) for a, b in zip(first_tokens, tokens)]
            agree = f"; greedy: {prefixes} of {args.greedy} tokens the same as {args.settings[0]}'s"
        print(
            f"{name:>7}: {nll:.4f} nats/token (perplexity {math.exp(nll):.2f}) over {count} tokens, "
            f"{nll - first:+.4f} against {args.settings[0]}{agree}",
            flush=True,
        )


if __name__ == "__main__":
    main()
