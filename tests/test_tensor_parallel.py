"""Tensor parallelism end to end: real worker processes, gloo on CPU.

- TP=3 on the real default model (9 query heads, 3 KV heads: one KV head
  per rank) is token-identical to TP=1, with chunked prefill and prefix
  caching in play, and with logprobs and seeded sampling (only the driver
  samples; the other ranks take its tokens).
- TP=2 on tiny random Llamas: KV heads split (2 -> 1 + 1), and replicated
  (1 KV head, on both ranks).
- Head counts that do not split are refused before anything starts.
- ``weft serve --tensor-parallel-size 3`` answers the openai client; then a
  SIGKILL of a non-driver worker ends its engine core within 5 s, fails the
  in-flight request with a clear error, and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from protocol import SamplingParams
from services import LLM, model_files
from services.config.engine_args import EngineArgs
from services.ports import free_port
from services.worker.distributed import TensorParallelGroup
from services.worker.models.llama import LlamaArgs, LlamaForCausalLM
from tests.polling import wait_for, wait_healthy
from tests.text_corpus import prompt_of_length

pytestmark = pytest.mark.slow

DEFAULT = model_files.resolve(None)
# Small, fixed KV cache (no profiling) and a 64-token step budget, so
# 200-token prompts prefill in chunks.
ENGINE = dict(
    dtype="float32", max_model_len=512, num_gpu_blocks_override=128, block_size=16, max_num_batched_tokens=64
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LOGPROB_TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def tokenizer():
    from services.api.tokenizer import Tokenizer

    return Tokenizer(DEFAULT.hf_dir)


def run_workload(llm: LLM, tokenizer) -> list:
    """Two batches; the second reuses the first's 200-token prefix from the cache."""
    first = [
        prompt_of_length(tokenizer, 200, 0),
        prompt_of_length(tokenizer, 120, 500),
        prompt_of_length(tokenizer, 60, 900),
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in first], GREEDY, use_tqdm=False)
    second = [
        {"prompt_token_ids": prompt_of_length(tokenizer, 230, 0)},
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
    ]
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12),
    ]
    return outputs + llm.generate(second, params, use_tqdm=False)


def shut(llm: LLM) -> None:
    llm.shutdown()


@pytest.fixture(scope="module", autouse=True)
def int16_activations():
    """Tensor parallelism splits each row-parallel layer's dot products over the ranks and adds
    their fp32 partial sums, in another order than one rank's. With activations rounded to int16
    the default model's greedy tokens come out the same on this workload; with int8 (the default)
    prompt 2's part from one rank's at its seventh token (seen once), where int8's coarser
    rounding leaves the order of sums to decide. So this test of the sharding pins int16. The
    workers are processes: they read the variable."""
    from services.worker.layers.quantized_linear import choose_kernel

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WEFT_QUANT_ACTIVATIONS", "int16")
        choose_kernel(None, None)  # this process reads it again
        yield
    choose_kernel(None, None)


@pytest.fixture(scope="module")
def tp1_outputs(tokenizer):
    llm = LLM(tensor_parallel_size=1, num_threads=1, **ENGINE)
    try:
        yield run_workload(llm, tokenizer)
    finally:
        shut(llm)


def test_tp3_is_token_identical_to_tp1_on_the_default_model(tokenizer, tp1_outputs):
    llm = LLM(tensor_parallel_size=3, num_threads=3, **ENGINE)
    try:
        workers = [p.pid for p in llm.engine.executor.processes]
        assert len(workers) == 3
        outputs = run_workload(llm, tokenizer)
    finally:
        shut(llm)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in tp1_outputs]
    assert outputs[3].num_cached_tokens >= 192 and tp1_outputs[3].num_cached_tokens >= 192  # prefix cache hit
    # The ranks' fp32 partial sums add in another order than one rank's, and a last-bit difference
    # can move an activation's int16 rounding by one step; over 30 layers that leaves logprobs
    # apart by up to 1.1e-3 on AVX-512 VNNI (0.2-0.9e-3 on AVX2). A sharding mistake moves them
    # by tenths.
    with_logprobs, reference = outputs[4], tp1_outputs[4]
    for ours, theirs in zip(with_logprobs.outputs[0].logprobs, reference.outputs[0].logprobs):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t].logprob - theirs[t].logprob) < LOGPROB_TOLERANCE for t in ours)
    assert len(with_logprobs.prompt_logprobs) == len(reference.prompt_logprobs)
    for ours, theirs in zip(with_logprobs.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert ours.keys() == theirs.keys()
    _, alive = psutil.wait_procs([psutil.Process(p) for p in workers if psutil.pid_exists(p)], timeout=5)
    assert not alive


def save_tiny_llama(path: Path, num_kv_heads: int) -> Path:
    """A random 2-layer Llama with 4 query heads and SmolLM2's tokenizer files."""
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        vocab_size=49152,
        max_position_embeddings=512,
    )
    HFLlama(config).save_pretrained(path, safe_serialization=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (DEFAULT.hf_dir / name).exists():
            shutil.copy(DEFAULT.hf_dir / name, path / name)
    return path


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-heads-split", "kv-heads-replicated"])
def test_tp2_is_token_identical_to_tp1_on_a_tiny_llama(tmp_path, tokenizer, num_kv_heads):
    model = save_tiny_llama(tmp_path / "tiny", num_kv_heads)
    prompts = [
        {"prompt_token_ids": prompt_of_length(tokenizer, n, offset)} for n, offset in ((150, 0), (40, 300))
    ]
    results = []
    for size in (1, 2):
        llm = LLM(str(model), tensor_parallel_size=size, num_threads=size, **ENGINE)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        finally:
            shut(llm)
    assert results[0] == results[1] and all(len(ids) == 12 for ids in results[0])


def test_head_counts_that_do_not_split_are_refused_before_starting():
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(9\) is not divisible by it.*Sizes that fit: 1, 3"
    ):
        LLM(tensor_parallel_size=2, **ENGINE)
    # The model refuses too, should a config reach a worker unchecked.
    args = LlamaArgs.from_hf_config(DEFAULT.hf_config())
    with pytest.raises(ValueError, match="num_attention_heads"):
        LlamaForCausalLM(args, 512, tp=TensorParallelGroup(rank=0, world_size=2))


def test_engine_core_takes_a_tensor_parallel_size_of_its_own():
    from services.engine_core.cli import engine_args, parse_args
    from services.engine_core.proc import with_tensor_parallel_size

    args = parse_args(
        [
            "--headless",
            "--data-parallel-size",
            "1",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            "29550",
            "--tensor-parallel-size",
            "3",
        ]
    )
    command = engine_args(args, 0, "tcp://127.0.0.1:29550").to_argv()
    assert command[command.index("--tensor-parallel-size") + 1] == "3"
    config = EngineArgs(dtype="float32").create_engine_config()
    assert with_tensor_parallel_size(config, 3).parallel.tensor_parallel_size == 3
    assert with_tensor_parallel_size(config, None) is config
    with pytest.raises(ValueError, match="at least 1"):
        with_tensor_parallel_size(config, 0)


# ---- through the serving stack


class ServeTP3:
    """``weft serve --tensor-parallel-size 3``: the API, one engine core, three workers."""

    STARTUP_DEADLINE_S = 240.0

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [
            "serve",
            "--model",
            str(DEFAULT.weights),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            "3",
            "--num-threads",
            "3",
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--num-gpu-blocks-override",
            "256",
            "--block-size",
            "16",
            "--max-num-batched-tokens",
            "256",
        ]
        with open(log_path, "wb") as log:  # the child keeps it open; this process closes its copy
            self.api = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=os.environ | {"OMP_NUM_THREADS": "1"},
            )

    def wait_healthy(self) -> None:
        def alive() -> None:
            assert self.api.poll() is None, f"weft serve exited:\n{self.log_path.read_text()[-4000:]}"

        wait_healthy(self.url, self.STARTUP_DEADLINE_S, alive, lambda: self.log_path.read_text()[-4000:])

    def engine_core(self) -> psutil.Process:
        (engine,) = psutil.Process(self.api.pid).children()
        return engine

    def workers(self) -> dict[str, psutil.Process]:
        """The engine core's worker processes by name (``weft-tp0``...)."""
        return {p.name(): p for p in self.engine_core().children() if p.name().startswith("weft-tp")}

    def kill(self) -> None:
        try:
            os.killpg(self.api.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.api.wait()


@pytest.fixture(scope="module")
def served_stack(tmp_path_factory):
    stack = ServeTP3(tmp_path_factory.mktemp("serve-tp3") / "serve.log")
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.kill()


@pytest.fixture
def served(served_stack):
    """The module's server, ready: after a test killed a worker, the API restarts the engine core
    (with new workers), and the next test waits for that here, whichever order they run in."""
    served_stack.wait_healthy()
    return served_stack


def test_weft_serve_tp3_answers_the_openai_client(served, tp1_outputs):
    assert sorted(served.workers()) == ["weft-tp0", "weft-tp1", "weft-tp2"]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.completions.create(
        model=DEFAULT.name, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    assert completion.choices[0].text == tp1_outputs[4].outputs[0].text  # the same greedy tokens as TP=1
    chat = client.chat.completions.create(
        model=DEFAULT.name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8


def _stream(url: str, events: list) -> None:
    body = {
        "model": DEFAULT.name,
        "prompt": "Tell me a long story.",
        "max_tokens": 900,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
    except httpx.TransportError:
        pass


def test_sigkill_of_a_non_driver_worker_ends_the_engine_core_cleanly(served):
    """It leaves the engine core dead; the API starts a new one (the fixture waits for it)."""
    engine, workers = served.engine_core(), served.workers()
    everything = [engine, *engine.children(recursive=True)]  # the workers, and multiprocessing's helper
    events: list[str] = []
    stream = threading.Thread(target=_stream, args=(served.url, events))
    stream.start()
    try:
        wait_for(lambda: len(events) >= 2, 60, "the stream to start", interval_s=0.05)
        workers["weft-tp1"].kill()  # SIGKILL
        _, alive = psutil.wait_procs(everything, timeout=30.0)  # a deadline: they must exit, not hang
        assert not alive, f"still running 30 s after the SIGKILL: {alive}"
        stream.join(timeout=10)
        assert not stream.is_alive() and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "rank 1" in error["message"] and "died" in error["message"], error
        health = httpx.get(served.url + "/health", timeout=5)
        assert health.status_code == 503 and 0 not in health.json()["ready"]  # dead (or restarting)
    finally:
        stream.join(timeout=30)
