"""``LLM(kv_transfer_config=...)``: a producer engine saves its prompts' KV
blocks to a shared folder, and a consumer engine built afterwards (another
engine, another KV cache) finds and loads them instead of computing them,
with the same greedy outputs. A producer computes like any engine, so its own
outputs are the ordinary ones."""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from services.model_files import resolve
from tests.text_corpus import prompt_of_length

pytestmark = pytest.mark.slow

ENGINE = dict(
    dtype="float32", max_model_len=256, num_gpu_blocks_override=64, block_size=16, max_num_batched_tokens=256
)


def shared_storage(role: str, path) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def test_a_consumer_llm_loads_what_a_producer_llm_saved(tmp_path):
    from services import LLM

    model = str(resolve(None).weights)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    producer = LLM(model, **ENGINE, kv_transfer_config=shared_storage("kv_producer", tmp_path))
    try:
        prompts = [
            {"prompt_token_ids": prompt_of_length(producer.tokenizer, n, offset=7 * n)} for n in (50, 83)
        ]
        expected = producer.generate(prompts, params, use_tqdm=False)
        # generate() returns once the saves are done and the held blocks are back.
        assert producer.engine.scheduler.kv_cache_manager.all_blocks_free()
    finally:
        producer.shutdown()
    # Every prompt token but the last: (50 - 1) // 16 full blocks and a partial one, (83 - 1) // 16 and one.
    assert len(list(tmp_path.glob("*.safetensors"))) == 4 + 6

    consumer = LLM(model, **ENGINE, kv_transfer_config=shared_storage("kv_consumer", tmp_path))
    try:
        got = consumer.generate(prompts, params, use_tqdm=False)
        assert consumer.engine.scheduler.kv_cache_manager.all_blocks_free()
    finally:
        consumer.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.num_cached_tokens for o in got] == [49, 82]  # loaded, not computed: all but the last token
    assert [o.num_cached_tokens for o in expected] == [0, 0]
