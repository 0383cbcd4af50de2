"""Async scheduling on the real default model: the offline ``LLM`` with and without
``async_scheduling`` gives the same greedy tokens, in fp32 and bf16, with chunked
prefill, preemption under a small KV cache, stop strings (an abort from the front
end, applied a step late), stop token ids, EOS and max_tokens all in play; and
with tensor-parallel worker processes.
"""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from services import LLM
from tests.text_corpus import prompt_of_length
from tests.utils import recorded_steps

pytestmark = pytest.mark.slow

# (length, offset) into the corpus; two share a long prefix.
PROMPT_SHAPES = [(9, 300), (40, 500), (150, 700), (300, 0), (220, 0), (70, 900)]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from services.api.tokenizer import Tokenizer

    return Tokenizer(default_model.hf_dir)


def workload(tokenizer) -> tuple[list, list[SamplingParams]]:
    prompts = [{"prompt_token_ids": prompt_of_length(tokenizer, n, offset)} for n, offset in PROMPT_SHAPES]
    prompts.append("Count with me: one, two, three, four, five, six,")
    prompts.append("The capital of France is")
    greedy = dict(temperature=0.0, logprobs=2)
    params = [SamplingParams(max_tokens=n, **greedy) for n in (40, 1, 24, 33, 16, 48)]
    params.append(SamplingParams(max_tokens=30, stop=[" ten"], **greedy))
    params.append(SamplingParams(max_tokens=30, stop_token_ids=[tokenizer.encode(".")[0]], **greedy))
    return prompts, params


def run(tokenizer, async_scheduling: bool, dtype: str):
    # 28 usable blocks: each request fits, all of them at once do not (preemption);
    # a 96-token budget splits the longer prompts into chunks. No dense weight copy: it
    # switches kernels by a step's row count, and async steps differ in rows (a request
    # stopped a step late still has its row), so in bf16 a near-tie could round the other
    # way; this test is about scheduling, so every row is computed by the same kernel. One
    # thread for the same reason: a CPU step's thread count follows its token count
    # (services/worker/cpu_threads.py), and the attention kernels split work by threads. And a
    # bf16 KV cache: over an int8 one a decode's query is rounded to int8 and a recomputed
    # (preempted) token's is not, which parts more near-ties (measured: 0.125 nats apart).
    llm = LLM(
        dtype=dtype,
        kv_cache_dtype="model",
        dense_min_rows=0,
        num_threads=1,
        max_model_len=448,
        num_gpu_blocks_override=29,
        block_size=16,
        max_num_batched_tokens=96,
        async_scheduling=async_scheduling,
    )
    try:
        prompts, params = workload(tokenizer)
        with recorded_steps(llm) as steps:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.kv_cache_manager.all_blocks_free()
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outputs], steps


# bf16 only: the top-2 logprob gap (nats) under which the two loops may part. A step's
# attention kernel follows the sizes of its prefill chunks (paged kernel or SDPA,
# services/worker/layers/attention_metadata.py), and async steps are composed differently
# (a request stopped a step late keeps its row), so bf16 rounding may tip a near-tie. One bf16
# step of a logit between 16 and 32 is 0.125 nats: two logits one step apart are a tie to bf16's
# resolution (on an AVX2-only Zen 3, whose bf16 runs take the fp32 attention paths, request 4
# parted at such a gap, -3.277 against -3.402; it did on the commit before this bound, too).
BF16_NEAR_TIE = 0.13


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_are_token_identical_with_and_without_async_scheduling(monkeypatch, tokenizer, dtype):
    # Prefill attention off AMX tiles (the engine's processes inherit the switch): a preempted
    # request's recomputed tokens run the prefill kernel where they first ran the decode one, and
    # tiles sum a row's products in another order than both kernels' vdpbf16ps paths do; on an AMX
    # Xeon that parted 4 of 8 requests at near-ties (one bf16 step of a logit, 0.125 nats), where
    # this test is about scheduling. tests/kernels/test_cpu_prefill_attention.py tests the tiles.
    monkeypatch.setenv("WEFT_ATTENTION_AMX", "0")
    sync, _ = run(tokenizer, False, dtype)
    ahead, steps = run(tokenizer, True, dtype)
    identical = 0
    for i, (a, s) in enumerate(zip(ahead, sync)):
        at = first_divergence(list(a.token_ids), list(s.token_ids))
        if at is not None and dtype == "bfloat16":
            top2 = sorted((lp.logprob for lp in s.logprobs[at].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < BF16_NEAR_TIE, f"request {i} parted at token {at}, not at a near-tie"
            continue
        assert list(a.token_ids) == list(s.token_ids), f"request {i}"
        assert (a.finish_reason, a.stop_reason, a.text) == (s.finish_reason, s.stop_reason, s.text), i
        identical += 1
    # bf16: every parting above is at a near-tie; how many there are follows the CPU's kernels
    # (2 of 8 on AVX-512 machines, 3 on an AVX2-only Zen 3), so half the requests must match.
    assert identical >= (len(sync) if dtype == "float32" else len(sync) // 2)
    assert any(s.preempted_req_ids for s in steps), "the small pool should have forced preemption"
    assert max(s.total_num_scheduled_tokens for s in steps) <= 96
    # The stop string cut the text; nothing after it reached the output.
    count = ahead[6]
    assert count.finish_reason == "stop" and count.stop_reason == " ten" and " ten" not in count.text
    assert len(ahead[1].token_ids) == 1 and ahead[1].finish_reason == "length"


def test_tensor_parallel_worker_processes_give_the_same_tokens():
    # The model's 9 heads and 3 KV heads split over 3 ranks; the steps reach the worker
    # processes from the engine's forward thread.
    prompts = ["The capital of France is", "Count with me: one, two, three,", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    tokens = {}
    for async_scheduling in (False, True):
        llm = LLM(
            tensor_parallel_size=3,
            async_scheduling=async_scheduling,
            num_gpu_blocks_override=64,
            block_size=16,
            max_model_len=512,
        )
        try:
            tokens[async_scheduling] = [
                list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)
            ]
        finally:
            llm.shutdown()
    assert tokens[True] == tokens[False]
    assert all(len(t) == 12 for t in tokens[True])
