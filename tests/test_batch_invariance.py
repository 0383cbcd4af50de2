"""Numerics that do not depend on the batch, at the defaults, on the real default model.

At temperature 0 a request's tokens must be the same whether it runs alone or
beside 7, 31 or 63 others (its prefill then cut into other chunks, its decode
rows in steps of other sizes), and n-gram speculation (K + 1 rows a verify
step) must give plain decoding's tokens: the same row gives the same logits
whatever shares its step (services/worker/layers/quantized_linear.py for the
linear layers, kernels/csrc/cpu_paged_attention.cpp for attention). And the
weights are resident once: within 1.15x the GGUF file's tensor bytes.
"""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from services import LLM
from services.config.engine_args import EngineArgs
from services.model_files import resolve
from services.worker.gguf_weights import GGUFCheckpoint
from services.worker.model_loader import load_model, weight_bytes
from tests.text_corpus import prompt_of_length
from tests.utils import gguf_parsed_once

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\n"
)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = LLM()  # every default: the packed weights alone, the default step budget
    yield llm
    llm.shutdown()


def test_the_defaults_keep_one_copy_of_the_weights(llm):
    """Resident weight bytes (the loader's accounting) within 1.15x the file's tensor bytes."""
    assert llm.config.model.dense_min_rows == 0
    files = resolve(None)
    loaded = weight_bytes(load_model(EngineArgs().create_engine_config().model))
    file_bytes = GGUFCheckpoint(files.weights).tensor_bytes
    assert loaded.int8_copies == 0
    assert loaded.total <= 1.15 * file_bytes, (loaded.describe(), file_bytes)


def others(llm: LLM, count: int) -> list[list[int]]:
    """Prompts of 9 to 64 tokens from the corpus, all different."""
    return [prompt_of_length(llm.tokenizer, 9 + (37 * i) % 56, 11 * i) for i in range(count)]


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_tokens_do_not_depend_on_what_shares_the_batch(llm):
    tok = llm.tokenizer
    targets = [
        tok.encode("The capital of France is"),
        prompt_of_length(tok, 200, 5),  # long enough to be chunked differently in a full step
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True
            ),
            add_special_tokens=False,
        ),
    ]
    alone = [tokens(llm.generate([t], greedy(), use_tqdm=False))[0] for t in targets]
    for size in (8, 32, 64):
        batch = others(llm, size - len(targets))
        # The targets first, in the middle and last: their rows sit at other offsets each time.
        middle = len(batch) // 2
        batch = [targets[0], *batch[:middle], targets[1], *batch[middle:], targets[2]]
        got = tokens(llm.generate(batch, greedy(), use_tqdm=False))
        assert [got[0], got[middle + 1], got[-1]] == alone, f"batch of {size}"


def test_seeded_sampling_is_reproducible_and_does_not_depend_on_the_batch(llm):
    """A seeded request samples the same tokens again, and beside other requests: its logits have the
    same bits at every row count, and its generator is its own."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32)
    prompt = "Once upon a time, in a small village by the sea,"
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    batch = [{"prompt_token_ids": p} for p in others(llm, 4)]
    batched = llm.generate([*batch, prompt], [greedy()] * 4 + [params], use_tqdm=False)
    assert alone == again == batched[-1].outputs[0].text


@pytest.fixture(scope="module")
def spec():
    llm = LLM(speculative_config=SPEC)
    yield llm
    llm.shutdown()


def test_ngram_speculation_at_the_defaults_gives_plain_decodings_tokens(llm, spec):
    tok = llm.tokenizer
    prompts = [
        tok.encode(CODE + "def div(a, b):\n    return a / b\n\n\n" + CODE),  # accepts drafts
        tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"),
        tok.encode("The cat sat on the mat. " * 6),
        prompt_of_length(tok, 60, 300),  # ordinary text: few drafts accepted
        tok.encode("Tell me about the weather on Mars."),
    ]
    before = spec.engine.stats_logger.spec_totals.num_accepted_tokens
    want = tokens(llm.generate(prompts, greedy(24), use_tqdm=False))
    got = tokens(spec.generate(prompts, greedy(24), use_tqdm=False))
    assert got == want
    assert spec.engine.stats_logger.spec_totals.num_accepted_tokens - before > 20  # drafts were verified
    # One at a time too: a verify step of one request alone.
    for prompt, expected in zip(prompts[:2], want[:2]):
        assert tokens(spec.generate([prompt], greedy(24), use_tqdm=False))[0] == expected


# A generated shape (random weights, the default tokenizer): its logits are close to uniform, so
# near-ties are everywhere, and a row whose bits moved with the batch would show. In llama.cpp's
# Q4_K_M mix (Q4_K, with Q6_K for attn_v, ffn_down and the tied embedding): those take the
# super-block path (x rounded per 256, tiles of their own), while the default model above covers
# the per-32 int4 tiles that Q4_0 shares with its Q4_1.
@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    from benchmarks.bench.make_model import write_model

    path = tmp_path_factory.mktemp("generated") / "tiny-llama-q4_k_m.gguf"
    # Its tokenizer (the default model's 49k strings) is read from one GGUF and, for its HF folder
    # (prepared here, once), from the other: each file parsed once (transformers opens it thrice).
    with gguf_parsed_once():
        write_model("tiny-llama", "Q4_K_M", path, log=lambda *args: None)
        resolve(str(path))
    return path


def test_a_generated_shape_keeps_one_copy_of_the_weights(generated):
    loaded = weight_bytes(load_model(EngineArgs(model=str(generated)).create_engine_config().model))
    assert loaded.total <= 1.15 * GGUFCheckpoint(generated).tensor_bytes, loaded.describe()


def test_a_generated_shape_is_batch_invariant_and_speculation_keeps_its_tokens(generated):
    plain = LLM(model=str(generated))
    try:
        targets = [prompt_of_length(plain.tokenizer, 40, 3), prompt_of_length(plain.tokenizer, 130, 50)]
        alone = [tokens(plain.generate([t], greedy(), use_tqdm=False))[0] for t in targets]
        for size in (8, 32, 64):
            batch = [targets[0], *others(plain, size - 2), targets[1]]
            got = tokens(plain.generate(batch, greedy(), use_tqdm=False))
            assert [got[0], got[-1]] == alone, f"batch of {size}"
        prompts = [*targets, *others(plain, 6)]
        want = tokens(plain.generate(prompts, greedy(24), use_tqdm=False))
    finally:
        plain.shutdown()
    spec = LLM(model=str(generated), speculative_config=SPEC)
    try:
        assert tokens(spec.generate(prompts, greedy(24), use_tqdm=False)) == want
    finally:
        spec.shutdown()
