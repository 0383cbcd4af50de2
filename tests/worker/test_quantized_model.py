"""The default model (SmolLM2-135M, Q4_1 with a Q8_0 embedding) kept quantized, end to end.

Kept quantized, it must produce the greedy tokens of the dequantized model
for most of 16 prompts (under int16 activations; under int8, the default, for
at least 6: ``AGREEMENT``); where one diverges, it must be at a near-tie of the
dequantized model's top two tokens (the weights are the same numbers; only
the rounding of activations and the order of fp32 sums differ). Its resident weights must shrink by
the factor the packed layouts predict, and the KV cache get what they free.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from protocol import SamplingParams
from services import LLM
from services.worker.layers.quantized_linear import quantized_report
from tests.text_corpus import prompt_of_length

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
# (length, offset) into the 1185-token corpus: short to long, different starting points.
PROMPT_SHAPES = [
    (7, 0),
    (12, 40),
    (20, 90),
    (33, 150),
    (48, 220),
    (64, 300),
    (90, 400),
    (128, 520),
    (150, 700),
    (200, 860),
    (256, 900),
    (300, 100),
    (360, 600),
    (420, 250),
    (500, 680),
    (600, 500),
]
# Per activation setting: the largest top-2 logprob gap (nats) of the dequantized model at a
# divergence (a near-tie), and the fewest of the 16 prompts that must match all 32 tokens.
# int8 activations (the default, as llama.cpp) move this 135M model's logits by up to ~0.1 nats:
# measured, 7 of 16 prompts matched fully and the other 9 left the dequantized model's greedy
# path at its top-2 token, at gaps of 0.009-0.139 nats. Their cost as a whole is the mean NLL
# the issue bounds (+0.01 nats; +0.004 measured by benchmarks/scripts/copy_likelihood.py), so under int8
# this test holds the divergences to near-ties of the dequantized top 2 at a looser bound.
AGREEMENT = {"int16": (0.05, 12), "fp32": (0.05, 12), "int8": (0.2, 6)}
# Bytes per parameter of the packed layouts (services/worker/gguf_repack.py).
BYTES_PER_PARAM = {"Q4_1": 0.625, "Q8_0": 1.0625}  # fp16 scales (and mins): the blocks' own


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    from services.api.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model.hf_dir)
    return [prompt_of_length(tokenizer, n, offset) for n, offset in PROMPT_SHAPES]


@dataclass(frozen=True)
class Memory:
    weights_bytes: int
    num_blocks: int
    block_bytes: int
    runtime_bytes: int  # the process before its model, which the budget holds too


def generate(quantization: str, prompts, logprobs: int | None):
    # 512-token steps: the cache is still sized by profiling (the last test compares the two
    # pools), but the profiled step is a quarter of the default 2048 tokens.
    # No dense copy: every step runs the packed kernels, which is what this module checks.
    dense = {"dense_min_rows": 0} if quantization == "gguf" else {}
    llm = LLM(
        dtype="float32", quantization=quantization, max_num_seqs=16, max_num_batched_tokens=512, **dense
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=logprobs, ignore_eos=True)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        worker = llm.engine.executor.worker
        runner = worker.model_runner
        memory = Memory(
            runner.weights_bytes, llm.engine.num_blocks, runner.kv_block_bytes, worker.runtime_bytes
        )
        return outputs, memory, quantized_report(runner.model)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def runs(prompts):
    # What both runs find available (0.9 of it is theirs): this process as it is now (the budget
    # holds it too, and in a whole test session it is several GiB) and 2 GiB for weights,
    # activations and KV cache, whatever the machine holds meanwhile, so the last test can compare
    # their pools.
    from services.worker.memory_profiling import rss_bytes

    available = int((rss_bytes() + (2 << 30)) / 0.9) + 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("services.config.engine_args.node_available_memory_or_none", lambda: available)
        return {"gguf": generate("gguf", prompts, None), "none": generate("none", prompts, 2)}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_quantized_greedy_tokens_match_dequantized(runs):
    from services.worker.layers.quantized_linear import activations_from_env

    near_tie, min_full = AGREEMENT[activations_from_env()]
    quantized, dequantized = runs["gguf"][0], runs["none"][0]
    full_matches, divergences = 0, []
    for i, (q, d) in enumerate(zip(quantized, dequantized)):
        assert len(q.token_ids) == len(d.token_ids) == NEW_TOKENS
        at = first_divergence(q.token_ids, d.token_ids)
        if at is None:
            full_matches += 1
            continue
        top2 = sorted(d.logprobs[at].values(), key=lambda lp: lp.logprob, reverse=True)[:2]
        divergences.append((i, at, top2[0].logprob - top2[1].logprob, q.token_ids[at] in d.logprobs[at]))
    print(
        f"{full_matches} of {len(quantized)} prompts match fully; divergences (prompt, token, gap, in top 2): "
        f"{divergences}"
    )
    for i, at, gap, in_top2 in divergences:
        assert gap < near_tie, f"prompt {i} diverged at token {at}, where the top-2 gap is {gap:.3f} nats"
        assert in_top2, f"prompt {i} chose a token outside the dequantized top 2"
    assert full_matches >= min_full  # "most": the rest diverge at near-ties only (checked above)


def test_resident_weights_shrink_by_the_packed_factor(runs):
    _, quantized, report = runs["gguf"]
    _, dense, dense_report = runs["none"]
    quantized_bytes, dense_bytes = quantized.weights_bytes, dense.weights_bytes
    assert dense_report.total_params == 0  # dequantized: nothing packed
    assert set(report.params) == set(BYTES_PER_PARAM)
    for fmt, per_param in BYTES_PER_PARAM.items():
        assert report.nbytes[fmt] == report.params[fmt] * per_param
    unpacked_params = dense_bytes // 4 - report.total_params  # the norms, still fp32
    assert quantized_bytes == report.total_bytes + 4 * unpacked_params
    assert dense_bytes / quantized_bytes > 4.5  # 4 bytes against 0.69 per parameter


def test_the_kv_cache_gets_the_memory_packing_frees(runs):
    """Same budget (2 GiB): the blocks gained cover most of the weight bytes saved (the rest is
    the profiled activation peak, which differs a little between the two; the process's own
    memory before its model, which the budget also holds, is taken out)."""
    quantized, dense = runs["gguf"][1], runs["none"][1]
    assert quantized.block_bytes == dense.block_bytes
    runtime_grown = dense.runtime_bytes - quantized.runtime_bytes  # what the first run left behind
    gained = (quantized.num_blocks - dense.num_blocks) * dense.block_bytes + runtime_grown
    assert gained >= 0.75 * (dense.weights_bytes - quantized.weights_bytes)
