"""Disaggregated prefill/decode end to end, for each connector: the proxy, a
prefill ``weft serve`` and a decode ``weft serve`` on loopback (and the
kv_transfer service for the ZmqConnector), against a single ordinary engine.

- greedy outputs through the proxy equal the ordinary engine's, for
  prompts of several blocks, streamed or not, completions and chat;
- the decode server loads the transferred prompt tokens instead of computing
  them: its ``vllm:external_prefix_cache_hits`` counter and each response's
  cached tokens count exactly them;
- a damaged stored block, a dead kv_transfer service or a vanished shared
  folder costs only speed: outputs stay correct and the decode server keeps
  serving;
- after every test no KV block is held on either side.

Prompts differ between requests, so no request gets local prefix hits from
another, and every count below is exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest

from protocol import SamplingParams
from services.config.engine_args import EngineArgs
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request
from services.kv_transfer.block_connector import block_namespace
from services.kv_transfer.keys import engine_curve_keys
from services.kv_transfer.shared_storage import FileBlockStore
from services.kv_transfer.zmq_connector import DOWN_RETRY_S, ServiceDownError, ZmqBlockStore
from tests.kv_transfer.pd_stack import MODEL, PDStack
from tests.polling import wait_for
from tests.text_corpus import prompt_of_length

pytestmark = pytest.mark.slow

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
BS = 16
MAX_TOKENS = 10
# The engine arguments of the stack (pd_stack.ENGINE_ARGS), for the ordinary engine.
ORDINARY = dict(
    dtype="float32", max_model_len=512, num_gpu_blocks_override=128, block_size=16, max_num_batched_tokens=256
)


@pytest.fixture(scope="module")
def oracle():
    from services import LLM

    llm = LLM(str(MODEL.weights), **ORDINARY)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=["ZmqConnector", "SharedStorageConnector"])
def stack(request, tmp_path_factory, oracle):
    stack = PDStack(request.param, tmp_path_factory.mktemp(request.param))
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.close()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


_offsets = iter(range(0, 10_000, 37))


def fresh_prompt(oracle, length: int) -> list[int]:
    """A prompt no earlier request used (a different stretch of the corpus)."""
    return prompt_of_length(oracle.tokenizer, length, offset=next(_offsets))


def expected_text(oracle, prompt: list[int]) -> str:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return oracle.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text


def transferable(prompt_len: int) -> int:
    """Prompt tokens a producer hands on: all but the last (its full blocks and the partial one)."""
    return prompt_len - 1


def test_greedy_outputs_equal_an_ordinary_engine(stack, client, oracle):
    hits_before = stack.counter(stack.decode_url, EXTERNAL_HITS)
    prompts = [fresh_prompt(oracle, n) for n in (40, 75, 130)]
    transferred = 0
    for i, prompt in enumerate(prompts):
        if i == 1:  # one of them streamed
            stream = client.completions.create(
                model=MODEL.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        else:
            response = client.completions.create(
                model=MODEL.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            text = response.choices[0].text
            # The decode server found the prompt's KV already computed.
            assert response.usage.prompt_tokens_details.cached_tokens == transferable(len(prompt))
        assert text == expected_text(oracle, prompt)
        transferred += transferable(len(prompt))
    assert stack.counter(stack.decode_url, EXTERNAL_HITS) - hits_before == transferred


def test_chat_streams_through_the_proxy(stack, client, oracle):
    messages = [{"role": "user", "content": " ".join(["Tell me about lighthouses and their keepers."] * 6)}]
    stream = client.chat.completions.create(
        model=MODEL.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    assert text == oracle.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_a_damaged_block_is_recomputed(stack, oracle):
    prompt = fresh_prompt(oracle, 70)  # 69 transferable tokens: 4 full blocks and 5 tokens of a 5th
    hits_before = stack.counter(stack.decode_url, EXTERNAL_HITS)
    body = {
        "model": MODEL.name,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    prefill = httpx.post(
        stack.prefill_url + "/v1/completions", json=body, headers=stack.trusted, timeout=120
    ).json()
    params = prefill["kv_transfer_params"]
    assert params == {"do_remote_prefill": True, "remote_num_tokens": 69}
    damage_block(stack, prompt, index=2)
    body.update(max_tokens=MAX_TOKENS, kv_transfer_params=params)
    decoded = httpx.post(
        stack.decode_url + "/v1/completions", json=body, headers=stack.trusted, timeout=120
    ).json()
    assert decoded["choices"][0]["text"] == expected_text(oracle, prompt)
    # Blocks 0 and 1 were loaded; block 2 failed its check, so it and the later ones were computed.
    assert stack.counter(stack.decode_url, EXTERNAL_HITS) - hits_before == 2 * BS


def damage_block(stack: PDStack, prompt: list[int], index: int) -> None:
    """Flip bits in one stored block once the producer has stored it, keeping its recorded MAC."""
    config = EngineArgs(model=str(MODEL.weights), **ORDINARY).create_engine_config()
    request = Request("probe", prompt, SamplingParams(), 0.0, block_hasher=make_block_hasher(BS))
    key = block_namespace(config) + request.block_hashes[index]
    if stack.connector == "ZmqConnector":
        store = ZmqBlockStore(
            f"tcp://127.0.0.1:{stack.kv_port}", timeout_s=10, curve=engine_curve_keys(stack.keys)
        )
        try:
            block = store.get([key], wait_s=30)[key]
            data = block.data.copy()
            data[len(data) // 2] ^= 0xFF
            block.data = data
            store.put([block])
        finally:
            store.close()
    else:
        store = FileBlockStore(stack.storage)
        assert store.get([key], wait_s=30), "the producer never wrote the block"
        path = store.file_of(key)
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF  # inside the tensor's bytes (the header comes first)
        path.write_bytes(bytes(raw))


@pytest.fixture(autouse=True)
def no_kv_block_is_left_held(stack):
    """After every test, both servers run nothing and hold no KV block."""
    yield
    stack.wait_until_idle()


def test_a_lost_transfer_path_costs_only_speed(stack, client, oracle):
    """ZmqConnector: the kv_transfer service is killed. SharedStorageConnector:
    the shared folder is gone (a file in its place), so nothing is saved or found.
    The path is put back afterwards, and transfers resume (so no test depends on
    running before this one)."""
    lose_transfer_path(stack)
    try:
        hits_before = stack.counter(stack.decode_url, EXTERNAL_HITS)
        prompt = fresh_prompt(oracle, 90)
        response = client.completions.create(
            model=MODEL.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert response.choices[0].text == expected_text(oracle, prompt)
        assert stack.counter(stack.decode_url, EXTERNAL_HITS) == hits_before  # everything was computed
        # The decode server keeps serving, and nothing is left held anywhere.
        assert httpx.get(stack.decode_url + "/health", timeout=10).status_code == 200
        stack.wait_until_idle()
    finally:
        restore_transfer_path(stack)

    # Transfers resume. The servers take a service that did not answer for down a few
    # seconds more (DOWN_RETRY_S: they fail fast meanwhile, and compute), so the first
    # request back may still be computed; a later one within the deadline transfers.
    def transferred() -> tuple[int, int] | None:
        """(blocks' tokens gained, prompt length) of a request that transferred, else None."""
        prompt = fresh_prompt(oracle, 60)
        hits_before = stack.counter(stack.decode_url, EXTERNAL_HITS)
        response = client.completions.create(
            model=MODEL.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert response.choices[0].text == expected_text(oracle, prompt)
        gained = stack.counter(stack.decode_url, EXTERNAL_HITS) - hits_before
        return (gained, len(prompt)) if gained else None

    gained, prompt_len = wait_for(
        transferred, 10 * DOWN_RETRY_S, "a transfer once the path is back", interval_s=0
    )
    assert gained == transferable(prompt_len)


def lose_transfer_path(stack: PDStack) -> None:
    if stack.connector == "ZmqConnector":
        stack.stop("kv-transfer")
    else:
        shutil.rmtree(stack.storage)
        stack.storage.write_bytes(b"not a folder")


def restore_transfer_path(stack: PDStack) -> None:
    if stack.connector == "ZmqConnector":
        stack.start_kv_transfer()
        wait_for(lambda: _service_answers(stack.kv_port, stack.keys), 60, "the kv_transfer service to answer")
    else:
        stack.storage.unlink()
        stack.storage.mkdir()


def _service_answers(port: int, keys: Path) -> bool:
    # With the engines' keys: the service takes CurveZMQ peers only.
    store = ZmqBlockStore(f"tcp://127.0.0.1:{port}", timeout_s=1, curve=engine_curve_keys(keys))
    try:
        store.stats()
        return True
    except (TimeoutError, ServiceDownError):  # down: marked so for a moment after a timeout
        return False
    finally:
        store.close()
