"""``weft serve`` sizes its KV cache and context from the machine's memory, and stops when an
engine cannot start.

Real servers over HTTP: Gemma 3 270M (a 32,768-token context) and the default model start with no
memory flag; a cache given too few bytes lowers the model's context, and the API's prompt check
follows the engine's choice; an engine that cannot start ends ``weft serve`` with its error instead
of being restarted for ever.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from services.model_files import models_dir, resolve
from services.ports import free_port
from tests.polling import wait_healthy

pytestmark = pytest.mark.slow

GEMMA3 = models_dir() / "gemma-3-270m-q4_k_m.gguf"
# The default model's KV block in fp32: K and V x 128 tokens x 3 KV heads x 64 x 4 bytes x 30 layers.
DEFAULT_FP32_BLOCK_BYTES = 2 * 128 * 3 * 64 * 4 * 30
START_TIMEOUT_S = 600
# A failed start is reported once the engine has loaded the model and profiled a step.
FAILED_START_TIMEOUT_S = 300


def _command(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]


@contextmanager
def serving(log_path: Path, *flags: str) -> Iterator[str]:
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _command(port, *flags),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | {"OMP_NUM_THREADS": "1"},
        )
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        return log_path.read_text(errors="replace")[-4000:]

    def running() -> None:
        assert proc.poll() is None, f"weft serve exited ({proc.returncode}):\n{tail()}"

    try:
        wait_healthy(url, START_TIMEOUT_S, running, tail)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def served_max_model_len(url: str) -> int:
    (card,) = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return card["max_model_len"]


def one_completion(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    name = client.models.list().data[0].id
    completion = client.completions.create(
        model=name, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    return completion.choices[0].text


def memory_plan_line(log_path: Path) -> str:
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if "Memory plan:" in line]
    assert lines, f"no memory plan in the log:\n{log_path.read_text(errors='replace')[-3000:]}"
    return lines[0]


def test_gemma3_starts_with_no_memory_flag_and_its_context_fits(tmp_path):
    assert GEMMA3.exists(), f"{GEMMA3} is missing: run `make model-gemma3` (make test does) first"
    native = resolve(str(GEMMA3)).hf_config()["max_position_embeddings"]
    log_path = tmp_path / "serve.log"
    with serving(log_path, "--model", str(GEMMA3)) as url:
        assert one_completion(url)
        context = served_max_model_len(url)
    plan = memory_plan_line(log_path)
    assert context <= native and f"max_model_len {context}" in plan
    assert "available at start" in plan and "activation peak" in plan and "KV cache" in plan


def test_the_default_model_starts_at_defaults_and_logs_its_memory_plan(tmp_path):
    log_path = tmp_path / "serve.log"
    with serving(log_path) as url:
        assert one_completion(url)
    plan = memory_plan_line(log_path)
    for part in ("available at start x 0.9", "weights", "packed", "dense", "other", "activation peak"):
        assert part in plan, plan
    assert re.search(r"KV cache [\d.]+ GiB in \d+ blocks of 128 tokens \([\d,]+ tokens", plan), plan


def test_a_small_cache_lowers_the_models_context_and_the_api_checks_prompts_against_it(tmp_path):
    blocks = 40  # 39 usable: 4,992 tokens of the model's 8,192
    log_path = tmp_path / "serve.log"
    flags = ("--dtype", "float32", "--kv-cache-dtype", "model")
    with serving(log_path, *flags, "--kv-cache-memory", str(blocks * DEFAULT_FP32_BLOCK_BYTES)) as url:
        context = served_max_model_len(url)
        assert context == (blocks - 1) * 128
        assert one_completion(url)
        too_long = httpx.post(
            url + "/v1/completions", json={"prompt": [1] * context, "max_tokens": 1}, timeout=60
        )
    assert too_long.status_code == 400 and f"maximum context length is {context}" in too_long.text
    assert f"max_model_len 8192 -> {context}: the KV cache holds {context:,} tokens" in log_path.read_text()


@pytest.mark.parametrize(
    "flags, error",
    [
        (("--kv-cache-memory", "1"), "which hold 0 tokens"),
        (
            (
                "--kv-cache-memory",
                str(10 * DEFAULT_FP32_BLOCK_BYTES),
                "--max-model-len",
                "8192",
                "--dtype",
                "float32",
                "--kv-cache-dtype",
                "model",
            ),
            "--max-model-len (8192 tokens) needs 65 blocks",
        ),
    ],
    ids=["one-byte-cache", "context-over-the-cache"],
)
def test_an_engine_that_cannot_start_stops_weft_serve_with_its_error(tmp_path, flags, error):
    result = subprocess.run(
        _command(free_port(), *flags),
        capture_output=True,
        text=True,
        timeout=FAILED_START_TIMEOUT_S,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "weft serve: engine core rank 0 failed to start" in result.stderr and error in result.stderr
    assert "Restarting engine core" not in output
