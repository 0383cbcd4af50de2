"""A forged KV block end to end: engines share a storage folder and a keys
folder; an attacker who can write to the folder but lacks the key replaces
one block of a saved prompt with KV of its own (a valid file, the right name,
a MAC made with another key). The consumer engine refuses it, computes that
block and the rest itself, and its greedy output equals the producer's."""

from __future__ import annotations

import os

import numpy as np
import pytest

from protocol import SamplingParams
from protocol.curve import generate_keys
from protocol.kv_transfer import KVBlock
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request
from services.kv_transfer.block_store import block_mac
from services.kv_transfer.shared_storage import FileBlockStore
from services.model_files import resolve
from tests.text_corpus import prompt_of_length

pytestmark = pytest.mark.slow

ENGINE = {
    "dtype": "float32",
    "max_model_len": 256,
    "num_gpu_blocks_override": 64,
    "block_size": 16,
    "max_num_batched_tokens": 256,
}
BS = 16


def shared_storage(role: str, path, keys) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path), "keys_dir": str(keys)},
    }


def forge(store: FileBlockStore, key: bytes) -> None:
    """Replace ``key``'s block by random KV sealed with a key of the attacker's own."""
    (genuine,) = store.get([key], 0.0).values()
    noise = np.random.default_rng(1).standard_normal(genuine.data.nbytes // 4).astype(np.float32)
    data = noise.view(np.uint8)
    mac = block_mac(os.urandom(32), key, genuine.dtype, genuine.shape, data)
    store.put([KVBlock(key, genuine.dtype, list(genuine.shape), 0, data, mac)])


def test_a_forged_block_is_refused_and_the_consumer_computes_the_right_output(tmp_path):
    from services import LLM

    keys, storage = tmp_path / "keys", tmp_path / "kv"
    generate_keys(keys)
    model = str(resolve(None).weights)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    producer = LLM(model, **ENGINE, kv_transfer_config=shared_storage("kv_producer", storage, keys))
    try:
        prompt = prompt_of_length(producer.tokenizer, 70, offset=11)  # 4 blocks handed on
        expected = producer.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        key_of = producer.engine.scheduler.kv_transfer.connector.key_of
    finally:
        producer.shutdown()
    hashes = Request("probe", prompt, SamplingParams(), 0.0, block_hasher=make_block_hasher(BS)).block_hashes
    forge(FileBlockStore(storage), key_of(hashes[1]))

    consumer = LLM(model, **ENGINE, kv_transfer_config=shared_storage("kv_consumer", storage, keys))
    try:
        (got,) = consumer.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert consumer.engine.scheduler.kv_cache_manager.all_blocks_free()
    finally:
        consumer.shutdown()
    assert got.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert got.num_cached_tokens == BS  # block 0 loaded; the forged block 1 and the rest computed
