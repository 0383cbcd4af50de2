"""Speculative decoding end to end, on the real default model in fp32.

The same engine without speculation is the oracle: greedy outputs must be
token-identical, with chunked prefill (a small token budget) and prefix
caching (prompts sharing a prefix) in play, including for requests that
stop inside an accepted run of drafts, and no KV block may leak.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from protocol import SamplingParams
from services import LLM
from tests.text_corpus import prompt_of_length

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\n"
)
# Chat prompts the model answers briefly, ending with EOS.
CHATS = [
    # The answer copies the prompt up to its end-of-turn token (EOS), so EOS comes as an accepted draft.
    [
        {
            "role": "user",
            "content": "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
        }
    ],
    [{"role": "user", "content": "Say hello."}],
]


def make_llm(**kwargs) -> LLM:
    torch.set_num_threads(1)
    # A 48-token budget chunks every prompt here; prefix caching is on by default. No dense
    # weight copy in either engine (a speculative engine keeps none under auto; the plain one
    # would, and then its batched steps would run another kernel than the verify steps).
    return LLM(
        dtype="float32",
        num_threads=1,
        dense_min_rows=0,
        max_num_batched_tokens=48,
        max_model_len=1024,
        num_gpu_blocks_override=400,
        block_size=16,
        **kwargs,
    )


@pytest.fixture(scope="module")
def plain() -> LLM:
    llm = make_llm()
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec() -> LLM:
    llm = make_llm(speculative_config=SPEC)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    """Repetitive prompts (code, a list, a repeated phrase; two share the code
    as a prefix), ordinary text, and chat prompts that end with EOS."""
    tokenizer = plain.tokenizer
    texts = [
        CODE + "def div(a, b):\n    return a / b\n\n\n" + CODE,
        CODE + "Now the same functions with type hints:\n\n",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        "The cat sat on the mat. " * 6,
    ]
    ids = [tokenizer.encode(t) for t in texts]
    ids.append(prompt_of_length(tokenizer, 60, 300))
    ids += [
        tokenizer.encode(
            tokenizer.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False
        )
        for c in CHATS
    ]
    return ids


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kwargs.pop("max_tokens", MAX_TOKENS), **kwargs)


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts: list[list[int]]):
    outputs = [r.outputs[0] for r in plain.generate(prompts, greedy(), use_tqdm=False)]
    assert_no_leaks(plain)
    return outputs


@contextlib.contextmanager
def runs_cut_by_a_stop(llm: LLM):
    """Collect (request id, tokens the worker emitted, tokens kept) for every
    request that finished on a step whose accepted run went past its stop."""
    scheduler = llm.engine.scheduler
    original, cuts = scheduler.update_from_output, []

    def record(scheduler_output, runner_output):
        outputs = original(scheduler_output, runner_output)
        emitted = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        cuts.extend(
            (o.request_id, len(emitted[o.request_id]), len(o.new_token_ids))
            for o in outputs
            if o.finished and len(emitted.get(o.request_id, ())) > len(o.new_token_ids)
        )
        return outputs

    scheduler.update_from_output = record
    try:
        yield cuts
    finally:
        scheduler.update_from_output = original


def assert_no_leaks(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_manager.all_blocks_free()


def test_greedy_outputs_are_token_identical(spec: LLM, prompts, reference) -> None:
    before = spec.engine.stats_logger.spec_totals.num_accepted_tokens
    with runs_cut_by_a_stop(spec) as cuts:
        outputs = [r.outputs[0] for r in spec.generate(prompts, greedy(), use_tqdm=False)]
    assert cuts, "no request met EOS inside an accepted run"
    for got, want in zip(outputs, reference):
        assert got.token_ids == want.token_ids
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    # The chat answers end with EOS inside the budget: stops were met under speculation.
    assert [o.finish_reason for o in reference[-2:]] == ["stop", "stop"]
    totals = spec.engine.stats_logger.spec_totals
    assert (
        totals.num_accepted_tokens - before > 20
    )  # speculation did the work, mostly on the repetitive prompts
    assert_no_leaks(spec)


def first_new_token_index(tokens: list[int], start: int) -> int:
    """The first position at or after ``start`` whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_requests_stopping_mid_proposal_emit_the_same_tokens(spec: LLM, prompts, reference) -> None:
    code, cat = reference[0].token_ids, reference[3].token_ids
    stop_at = first_new_token_index(code, 6)
    cases = [(prompts[3], greedy(max_tokens=n), cat[:n], "length") for n in (2, 3, 5, 6, 9, 13)]
    cases += [
        (prompts[0], greedy(stop_token_ids=[code[stop_at]]), code[: stop_at + 1], "stop"),
        (prompts[0], greedy(max_tokens=10), code[:10], "length"),
    ]
    before = spec.engine.stats_logger.spec_totals.num_accepted_tokens
    with runs_cut_by_a_stop(spec) as cuts:
        outputs = spec.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    # The stop token came inside an accepted run; max_tokens caps the drafts instead.
    assert [request_id for request_id, _, _ in cuts] == [outputs[6].request_id + "-0"]
    for output, (_, _, want, reason) in zip(outputs, cases):
        assert output.outputs[0].token_ids == want
        assert output.outputs[0].finish_reason == reason
    assert outputs[6].outputs[0].stop_reason == code[stop_at]
    # Nearly every token came from an accepted draft, so the stops fell inside accepted runs.
    assert spec.engine.stats_logger.spec_totals.num_accepted_tokens - before > 30
    assert_no_leaks(spec)


def test_stop_strings_cut_the_accepted_run(spec: LLM, prompts, reference) -> None:
    text = reference[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    want = text[: text.index(stop)]
    output = spec.generate([prompts[0]], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert output.text == want and output.finish_reason == "stop" and output.stop_reason == stop
    assert_no_leaks(spec)


# A verify step's attention differs from a decode step's by ~1e-6; with the packed weights'
# activations rounded to int8 (the default) or int16 that can move a value across a rounding step,
# which reaches the logprobs as ~1e-3. Wrong positions or tokens would be off by far more.
LOGPROB_TOLERANCE = {"fp32": 1e-3, "int16": 3e-3, "int8": 3e-2}


def test_logprobs_of_accepted_tokens_match(plain: LLM, spec: LLM, prompts) -> None:
    from services.worker.layers.quantized_linear import activations_from_env

    tolerance = LOGPROB_TOLERANCE[activations_from_env()]
    params = greedy(max_tokens=16, logprobs=2)
    want = plain.generate(prompts[:3], params, use_tqdm=False)
    got = spec.generate(prompts[:3], params, use_tqdm=False)
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 16
        for g_entry, w_entry in zip(g.logprobs, w.logprobs):
            assert g_entry.keys() == w_entry.keys()
            for token, logprob in w_entry.items():
                assert g_entry[token].logprob == pytest.approx(logprob.logprob, abs=tolerance)
                assert g_entry[token].rank == logprob.rank


def test_seeded_random_sampling_repeats(spec: LLM, prompts) -> None:
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24),
        SamplingParams(temperature=1.0, top_k=20, frequency_penalty=0.5, seed=3, max_tokens=24),
    ]
    first = spec.generate(prompts[:2], params, use_tqdm=False)
    second = spec.generate(prompts[:2], params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in first] == [r.outputs[0].token_ids for r in second]
    assert all(len(r.outputs[0].token_ids) == 24 for r in first)
    assert_no_leaks(spec)
