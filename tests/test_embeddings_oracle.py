"""Offline embeddings (``LLM.embed``) against transformers on the same checkpoint.

weft runs the default model dequantized to fp32 (``quantization="none"``); the oracle is
transformers' fp32 model of the same GGUF: its last hidden states (after the final norm,
``output_hidden_states``), pooled at the last token or by the mean over the prompt, then
L2-normalized. Small steps (32 tokens) split the longer prompts into chunks, so mean pooling's
running sum over chunks is what is checked; the second pass of the same texts finds their
prefixes in the cache (last-token pooling) and must not change a vector.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol import PoolingParams, PoolingType
from services import LLM
from services.api.tokenizer import Tokenizer
from tests.text_corpus import prompt_of_length

pytestmark = pytest.mark.slow

MAX_COSINE_DISTANCE = 1e-4


@pytest.fixture(scope="module")
def llm():
    llm = LLM(
        dtype="float32",
        quantization="none",
        max_model_len=512,
        max_num_batched_tokens=32,
        block_size=16,
        num_threads=1,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    tokenizer = Tokenizer(default_model.hf_dir)
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", "Bananas are yellow."]
    corpus = [prompt_of_length(tokenizer, n, offset) for n, offset in ((45, 300), (100, 700))]
    return [tokenizer.encode(t) for t in texts] + corpus


def oracle(hf_model, prompt: list[int], pooling_type: PoolingType) -> np.ndarray:
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].double()  # [T, H], after the final norm
    pooled = hidden[-1] if pooling_type == PoolingType.LAST else hidden.mean(dim=0)
    return (pooled / pooled.norm()).numpy()


@pytest.mark.parametrize("pooling_type", [PoolingType.LAST, PoolingType.MEAN])
def test_embeddings_match_transformers_pooled_hidden_states(llm, hf_default_model, prompts, pooling_type):
    params = PoolingParams(pooling_type)
    for attempt in ("fresh", "again"):  # again: last-token pooling reads cached prefixes
        outputs = llm.embed(prompts, use_tqdm=False, pooling_params=params)
        for prompt, output in zip(prompts, outputs):
            assert output.prompt_token_ids == prompt
            ours = np.asarray(output.outputs.embedding, dtype=np.float64)
            assert np.linalg.norm(ours) == pytest.approx(1.0, abs=1e-5)
            distance = 1.0 - float(ours @ oracle(hf_default_model, prompt, pooling_type))
            assert distance < MAX_COSINE_DISTANCE, f"{attempt}, {len(prompt)} tokens: {distance}"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_manager.all_blocks_free()


def test_the_default_pooler_of_a_decoder_model_is_the_last_token(llm, prompts):
    assert llm.config.model.pooler == "last"
    default = llm.embed(prompts[:2], use_tqdm=False)
    last = llm.embed(prompts[:2], use_tqdm=False, pooling_params=PoolingParams(PoolingType.LAST))
    assert [o.outputs.embedding for o in default] == [o.outputs.embedding for o in last]
