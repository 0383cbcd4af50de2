"""The offline engine end to end, on the real default model in fp32.

Transformers on the same GGUF checkpoint is the oracle: greedy outputs must
be its greedy tokens, token for token (``tests.utils.GreedyOracle`` checks a
continuation with one forward pass), with chunked prefill, prefix caching and
preemption all in play.
"""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from services import LLM
from tests.text_corpus import prompt_of_length
from tests.utils import GreedyOracle, recorded_steps

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
# (length, offset) into the corpus: prompts 3, 4 and 6 start at offset 0,
# so they share long prefixes (many full blocks) with each other.
PROMPT_SHAPES = [(10, 300), (37, 500), (120, 700), (600, 0), (250, 0), (75, 900), (400, 0), (180, 1000)]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from services.api.tokenizer import Tokenizer

    return Tokenizer(default_model.hf_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [prompt_of_length(tokenizer, n, offset) for n, offset in PROMPT_SHAPES]


@pytest.fixture(scope="module")
def oracle(hf_default_model, tokenizer) -> GreedyOracle:
    return GreedyOracle(hf_default_model, tokenizer.eos_token_id)


def make_llm(**kwargs) -> LLM:
    """The pools and shared prefixes of these tests are counted in 16-token blocks.

    Dequantized weights (quantization "none"): these tests check the engine's scheduling
    (chunked prefill, prefix caching, preemption) against transformers token for token, and
    transformers runs the same dequantized fp32 weights. On an AVX2-only CPU the packed kernels
    (at int16 activations, the only ones that hold this exact oracle) took twice the CPU time of
    the dense fp32 GEMMs on these prefills; tests/worker/test_quantized_model.py checks them
    against transformers."""
    return LLM(dtype="float32", quantization="none", block_size=16, **kwargs)


def assert_no_leaks(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_manager.all_blocks_free()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def assert_matches_oracle(outputs, prompts, oracle) -> None:
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        oracle.check(prompt, list(out.outputs[0].token_ids), NEW_TOKENS, f"prompt {i} ({PROMPT_SHAPES[i]})")


@pytest.fixture(scope="module")
def llm():
    # A fixed pool of 600 blocks (one 8192-token sequence fits) instead of profiling
    # a 2048-token step: sizing the cache is tested in tests/worker/test_worker.py.
    engine = make_llm(num_gpu_blocks_override=600)
    yield engine
    engine.shutdown()


def test_greedy_matches_transformers_with_prefix_caching(llm, prompts, oracle):
    warm = llm.generate([prompts[6]], greedy(), use_tqdm=False)  # caches a 400-token prefix
    oracle.check(prompts[6], list(warm[0].outputs[0].token_ids), NEW_TOKENS, "the warm-up request")
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_oracle(outputs, prompts, oracle)
    assert outputs[3].num_cached_tokens >= 384 and outputs[4].num_cached_tokens >= 240
    assert_no_leaks(llm)


def test_greedy_matches_transformers_with_prefix_caching_in_the_cpu_default_blocks(prompts, oracle):
    """No block size asked: 128-token blocks on CPU, so hits come in multiples of 128 tokens."""
    llm = LLM(dtype="float32", quantization="none", num_gpu_blocks_override=80)
    try:
        assert llm.config.cache.block_size == 128
        llm.generate([prompts[6]], greedy(), use_tqdm=False)  # caches a 400-token prefix: three blocks
        outputs = llm.generate(prompts, greedy(), use_tqdm=False)
        assert_matches_oracle(outputs, prompts, oracle)
        assert (outputs[3].num_cached_tokens, outputs[4].num_cached_tokens) == (384, 128)
        assert all(o.num_cached_tokens % 128 == 0 for o in outputs)
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def chunked():
    """128-token steps and no prefix caching: every prompt token is prefilled, in chunks.
    Its tests read it and leave no request behind (assert_no_leaks)."""
    engine = make_llm(max_num_batched_tokens=128, enable_prefix_caching=False)
    yield engine
    engine.shutdown()


def test_greedy_matches_transformers_with_chunked_prefill(chunked, prompts, oracle):
    with recorded_steps(chunked) as steps:
        outputs = chunked.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_oracle(outputs, prompts, oracle)
    longest = outputs[3].request_id + "-0"
    prefill_chunks = [
        s.num_scheduled_tokens[longest] for s in steps if s.num_scheduled_tokens.get(longest, 0) > 1
    ]
    assert len(prefill_chunks) >= 4 and sum(prefill_chunks) == len(prompts[3])
    assert_no_leaks(chunked)


def test_prompt_logprobs_of_a_chunked_prefill_match_one_chunk(llm, chunked, prompts):
    """Each chunk scores the token after each of its own: none may be dropped at a chunk edge."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompt = prompts[3]  # 600 tokens: five chunks of at most 128
    (split,) = chunked.generate([prompt], params, use_tqdm=False)
    assert_no_leaks(chunked)
    (whole,) = llm.generate([prompt], params, use_tqdm=False)
    for out in (split, whole):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        assert all(prompt[p] in entry for p, entry in enumerate(out.prompt_logprobs) if p)
    for p in range(1, len(prompt)):
        got, want = split.prompt_logprobs[p][prompt[p]], whole.prompt_logprobs[p][prompt[p]]
        assert got.logprob == pytest.approx(want.logprob, abs=2e-3), p
    assert_no_leaks(llm)


def test_greedy_matches_transformers_under_preemption(prompts, oracle):
    # 44 usable blocks hold one 700-token request, but not all eight at once.
    llm = make_llm(max_model_len=700, num_gpu_blocks_override=48)
    with recorded_steps(llm) as steps:
        outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_oracle(outputs, prompts, oracle)
    assert any(s.preempted_req_ids for s in steps), "the small pool should have forced preemption"
    assert_no_leaks(llm)
    llm.shutdown()


def test_shared_three_block_prefix_is_served_from_cache(llm, tokenizer):
    block = 16
    base = tokenizer.encode("Notes from the harbour master, kept in a red notebook:") + prompt_of_length(
        tokenizer, 80, offset=200
    )
    first, second = base[: 3 * block + 10], base[: 3 * block] + tokenizer.encode(" Something else entirely.")
    llm.generate([first], greedy(), use_tqdm=False)
    with recorded_steps(llm) as steps:
        out = llm.generate([second], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    assert steps[0].num_scheduled_tokens[out.request_id + "-0"] == len(second) - 48
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1] * 9000}, "max_model_len"),
        ("", "empty"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_serving(llm, bad, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["A fine prompt.", bad], greedy(), use_tqdm=False)
    out = llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("n", 0), ("top_k", -5), ("min_p", 1.5)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_strings_token_ids_and_n(llm):
    prompt = "Count with me: one, two, three, four, five, six,"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text.strip().split()[1]  # a word the model does produce
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    base_ids = base.outputs[0].token_ids
    stop_id = base_ids[3]
    by_id = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.token_ids == base_ids[: base_ids.index(stop_id) + 1] and by_id.stop_reason == stop_id
    many = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)[
        0
    ]
    assert [o.index for o in many.outputs] == [0, 1, 2] and len({o.text for o in many.outputs}) > 1
    assert_no_leaks(llm)


def test_logprobs_and_chat(llm):
    out = llm.generate(
        ["The sky is"],
        SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    entries = out.outputs[0].logprobs
    assert len(entries) == 3
    for token_id, entry in zip(out.outputs[0].token_ids, entries):
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        assert entry[token_id].logprob <= 0.0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    reply = llm.chat(
        [{"role": "user", "content": "Say hello."}],
        SamplingParams(temperature=0, max_tokens=16),
        use_tqdm=False,
    )[0]
    assert reply.outputs[0].text and reply.prompt.startswith("<|im_start|>system")
    assert_no_leaks(llm)
