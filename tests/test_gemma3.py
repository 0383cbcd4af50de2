"""Gemma 3 270M end to end against transformers, offline and over ``weft serve``.

The checkpoint is the Q4_K_M GGUF assembled by ``make model-gemma3``
(``scripts/fetch_gemma3.py``); both sides dequantize it to fp32. Most of its
layers attend over a 512-token sliding window, so the prompts include some
longer than the window, and the engines run with chunked prefill, prefix
caching and a KV pool small enough to force preemption: the window layers'
KV blocks are released as they fall out of the window, and greedy tokens
must still match transformers' token for token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from protocol import SamplingParams
from services import LLM
from services.model_files import models_dir, resolve
from services.ports import free_port
from tests.polling import wait_healthy
from tests.text_corpus import prompt_of_length
from tests.utils import GreedyOracle, gguf_parsed_once, recorded_steps

pytestmark = pytest.mark.slow

GGUF = models_dir() / "gemma-3-270m-q4_k_m.gguf"
NEW_TOKENS = 16
# (length, offset) into the corpus: two prompts longer than the window, sharing a long
# prefix with each other and with a shorter one (prefix-cache hits across window layers).
PROMPT_SHAPES = [(10, 300), (37, 500), (700, 0), (120, 700), (250, 0), (75, 900), (600, 0)]
# Over HTTP: one short prompt and one longer than the window.
SERVED = [0, 2]
# Small steps (chunked prefill) and a pool that holds the longest request but not all eight.
ENGINE_ARGS = {
    "max_model_len": 1024,
    "max_num_batched_tokens": 128,
    "num_gpu_blocks_override": 300,
    "block_size": 16,
    "quantization": "none",  # the oracle runs the dequantized GGUF; so does weft here
}


@pytest.fixture(scope="module")
def files():
    assert GGUF.exists(), f"{GGUF} is missing: run `make model-gemma3` (make test does) first"
    return resolve(str(GGUF))


@pytest.fixture(scope="module")
def tokenizer(files):
    from services.api.tokenizer import Tokenizer

    return Tokenizer(files.hf_dir)  # a 262k-token vocabulary: seconds to read, once


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    bos = tokenizer.backend.token_to_id(tokenizer.bos_token)
    return [[bos] + prompt_of_length(tokenizer, n - 1, offset) for n, offset in PROMPT_SHAPES]


@pytest.fixture(scope="module")
def oracle(files) -> GreedyOracle:
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
    model.eval()
    yield GreedyOracle(model, files.hf_config()["eos_token_id"])
    del model


@dataclass
class OfflineRun:
    warm: list[int]  # the first request's tokens, alone in the engine
    tokens: list[list[int]]  # then all the prompts together, in order
    cached: list[int]  # each one's prefix-cache hit
    steps: list  # the scheduler outputs of the second generate
    num_groups: int
    all_blocks_free: bool


@pytest.fixture(scope="module")
def offline(prompts) -> OfflineRun:
    """One engine run: the 700-token prompt alone (it fills the prefix cache), then all of them."""
    llm = LLM(model=str(GGUF), dtype="float32", **ENGINE_ARGS)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        warm = llm.generate([{"prompt_token_ids": prompts[2]}], greedy, use_tqdm=False)
        with recorded_steps(llm) as steps:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        kv = llm.engine.scheduler.kv_cache_manager
        return OfflineRun(
            warm=list(warm[0].outputs[0].token_ids),
            tokens=[list(o.outputs[0].token_ids) for o in outputs],
            cached=[o.num_cached_tokens for o in outputs],
            steps=steps,
            num_groups=kv.num_groups,
            all_blocks_free=kv.all_blocks_free(),
        )
    finally:
        llm.shutdown()


def test_offline_greedy_matches_transformers(prompts, oracle, offline):
    oracle.check(prompts[2], offline.warm, NEW_TOKENS, "the warm-up request")
    for i, tokens in enumerate(offline.tokens):
        oracle.check(prompts[i], tokens, NEW_TOKENS, f"prompt {i} ({PROMPT_SHAPES[i]})")
    steps = offline.steps
    assert any(s.preempted_req_ids for s in steps), "the small pool should have forced preemption"
    assert max(offline.cached) >= 240  # a prefix hit on the warm request
    assert any(n > 1 and n < len(prompts[6]) for s in steps for n in s.num_scheduled_tokens.values())
    assert offline.num_groups == 6 and offline.all_blocks_free


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    port = free_port()
    args = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    log_path = tmp_path_factory.mktemp("gemma3-serve") / "serve.log"

    def tail():
        return log_path.read_text(errors="replace")[-3000:]

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "serve",
                "--model",
                str(GGUF),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | {"OMP_NUM_THREADS": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 300, lambda: _check_running(proc, tail), tail)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _check_running(proc: subprocess.Popen, tail) -> None:
    assert proc.poll() is None, f"weft serve exited ({proc.returncode}):\n{tail()}"


def test_served_greedy_matches_transformers(server, files, tokenizer, prompts, oracle, offline):
    """Over HTTP the text is the decoded greedy tokens, which the offline run produced and
    transformers confirms (the API returns text, not ids)."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(
        model=files.name, prompt=[prompts[i] for i in SERVED], max_tokens=NEW_TOKENS, temperature=0
    )
    assert len(completion.choices) == len(SERVED)
    for choice in completion.choices:
        i = SERVED[choice.index]
        tokens = offline.tokens[i]
        oracle.check(prompts[i], tokens, NEW_TOKENS, f"prompt {i} ({PROMPT_SHAPES[i]})")
        expected = tokenizer.backend.decode(tokens, skip_special_tokens=True)
        assert choice.text == expected, f"served prompt {i} ({PROMPT_SHAPES[i]}) diverged"
    assert completion.usage.completion_tokens == sum(len(offline.tokens[i]) for i in SERVED)


def test_chat_without_a_template_is_a_clear_400(server, files):
    response = httpx.post(
        server + "/v1/chat/completions",
        timeout=30,
        json={"model": files.name, "messages": [{"role": "user", "content": "Hello"}]},
    )
    assert response.status_code == 400
    assert "chat template" in response.json()["error"]["message"].lower()
