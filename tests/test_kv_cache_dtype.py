"""``--kv-cache-dtype``: what each setting resolves to, what is refused, and an int8 cache end to end.

The kernels' own tests (write, decode and prefill against their torch twins) are in
tests/kernels/test_cpu_attention_int8.py; here the engine: the choice, the cache it allocates,
and what it costs the model by its own measure (likelihood of natural text, and greedy text).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from protocol import SamplingParams
from services import LLM
from services.api.tokenizer import Tokenizer
from services.config.cli_args import add_engine_args, engine_args_from
from services.config.engine_args import EngineArgs, resolve_kv_cache_dtype
from services.worker.model_runner import resolve_kv_int8
from tests.test_int8_dense_copy_llm import mean_nll
from tests.text_corpus import prompt_of_length


def cache_dtype_of(*argv: str) -> str:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from(parser.parse_args(list(argv))).create_engine_config().cache.cache_dtype


def test_auto_leaves_bf16_on_cpu_to_the_worker_and_keeps_the_rest_in_the_model_dtype():
    assert cache_dtype_of("--device", "cpu", "--dtype", "bfloat16") == "auto"
    assert cache_dtype_of("--device", "cpu", "--dtype", "float32") == "model"  # fp32 runs stay exact
    assert EngineArgs(device="cuda").create_engine_config().cache.cache_dtype == "model"
    assert resolve_kv_cache_dtype("auto", "cpu", "bfloat16", kv_transfer=True) == "model"


def test_asked_settings_are_kept_and_the_model_dtype_by_name_is_model():
    assert cache_dtype_of("--device", "cpu", "--kv-cache-dtype", "int8", "--dtype", "float32") == "int8"
    assert cache_dtype_of("--device", "cpu", "--kv-cache-dtype", "model") == "model"
    assert cache_dtype_of("--device", "cpu", "--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16") == "model"
    assert resolve_kv_cache_dtype("bf16", "cpu", "bfloat16", kv_transfer=False) == "model"


@pytest.mark.parametrize(
    ("value", "device", "kv_transfer", "message"),
    [
        ("fp8", "cpu", False, "fp8 KV caches are not supported"),
        ("fp8_e5m2", "cpu", False, "fp8 KV caches are not supported"),
        ("int4", "cpu", False, "kv_cache_dtype must be one of auto, model, int8"),
        ("float16", "cpu", False, r"or the model dtype \(bfloat16\)"),
        ("int8", "cuda", False, "runs on CPU only"),
        ("int8", "cpu", True, "cannot be combined with kv_transfer_config"),
    ],
)
def test_what_cannot_run_is_refused_with_the_reason(value, device, kv_transfer, message):
    with pytest.raises(ValueError, match=message):
        resolve_kv_cache_dtype(value, device, "bfloat16", kv_transfer=kv_transfer)


def test_auto_takes_int8_only_where_decodes_run_on_int8_dot_products():
    from kernels.cpu_attention import int8_dot_queries

    assert resolve_kv_int8("auto", "cpu", torch.bfloat16, 64) is int8_dot_queries(torch.bfloat16, 64)
    assert resolve_kv_int8("auto", "cpu", torch.bfloat16, 256) is False  # Gemma 3's: the generic path
    assert resolve_kv_int8("auto", "cpu", torch.float32, 64) is False
    assert resolve_kv_int8("auto", "torch", torch.bfloat16, 64) is False
    assert resolve_kv_int8("model", "cpu", torch.bfloat16, 64) is False
    # Asked for: the generic path runs any head size, the torch backend its torch ops.
    assert resolve_kv_int8("int8", "cpu", torch.float32, 80) is True
    assert resolve_kv_int8("int8", "torch", torch.bfloat16, 64) is True
    with pytest.raises(ValueError, match="runs on the CPU backends only"):
        resolve_kv_int8("int8", "triton", torch.bfloat16, 64)


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    tokenizer = Tokenizer(default_model.hf_dir)
    return [prompt_of_length(tokenizer, 400, offset) for offset in (0, 300, 600)]


@pytest.mark.slow  # the real model, twice: its likelihood of real text is the measure
def test_an_int8_cache_holds_1_9_times_the_tokens_at_no_measurable_likelihood_cost(prompts):
    nll, block_bytes, texts = {}, {}, {}
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5)
    for setting in ("model", "int8"):
        # The packed weights alone (the default: no dense or int8 copy), so that the cache is the
        # only difference. An int8 copy rounds each row of activations to one scale, which turned the
        # cache's small differences into a 0.375-nat gap at a near-tie (the packed kernels round per
        # group of 32); a bf16 copy runs prefills as bf16 GEMMs, minutes on a CPU without bf16 math.
        llm = LLM(dtype="bfloat16", kv_cache_dtype=setting, kv_cache_memory=1 << 30)
        try:
            assert llm.config.model.dense_min_rows == 0
            runner = llm.engine.executor.worker.model_runner
            assert runner.kv_int8 is (setting == "int8")
            assert {c.dtype for c in runner.kv_caches} == {
                torch.int8 if setting == "int8" else torch.bfloat16
            }
            block_bytes[setting] = runner.kv_block_bytes
            if setting == "int8":
                assert [s.shape for s in runner.kv_scales] == [c.shape[:-1] for c in runner.kv_caches]
                assert {s.dtype for s in runner.kv_scales} == {torch.float32}
            else:
                assert runner.kv_scales is None
            nll[setting] = mean_nll(llm, prompts)
            # Long enough that the answers' decodes read many cached blocks (128-token blocks). The
            # prompts are the likelihood pass's: their first three blocks are prefix-cache hits, so
            # the answers' prefills read the blocks that pass wrote instead of computing them again.
            answers = llm.generate(prompts, greedy, use_tqdm=False)
            assert [o.num_cached_tokens for o in answers] == [384] * len(prompts)
            texts[setting] = [o.outputs[0] for o in answers]
        finally:
            llm.shutdown()
    # 64 bytes of keys or values and a 4-byte scale per token and KV head, against 128 bytes: the
    # budget holds 1.88 times the tokens.
    assert block_bytes == {"model": 2 * 128 * 3 * 64 * 2 * 30, "int8": 2 * 128 * 3 * (64 + 4) * 30}, (
        block_bytes
    )
    # Measured: 3.086 and 3.086 nats a token (benchmarks/scripts/copy_likelihood.py's texts); a wrong scale or a
    # misread row costs whole nats.
    assert nll["model"] < 5.0
    assert abs(nll["int8"] - nll["model"]) < 0.01, nll
    # Greedy answers may part only at a near tie: where they do, each run ranks the other's token
    # within a quarter nat of its own (bf16 logits step by 1/8 at these magnitudes; on an AMX Xeon
    # one answer parted after 5 tokens at a tie of -2.97 / -2.97, the bf16 cache's -2.88 / -3.00).
    # A misread row or a wrong scale moves whole nats.
    for a, b in zip(texts["model"], texts["int8"]):
        part = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if part is None:
            continue
        for mine, other in ((a, b), (b, a)):
            ranked = mine.logprobs[part]
            assert other.token_ids[part] in ranked, (part, a.token_ids, b.token_ids)
            gap = ranked[mine.token_ids[part]].logprob - ranked[other.token_ids[part]].logprob
            assert gap <= 0.25, (part, gap, a.token_ids, b.token_ids)
