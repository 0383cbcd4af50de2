"""The whole serving stack, as users run it: real processes on loopback.

One stack, laid out as docker-compose.yml lays it out: ``weft serve`` with no
local engine core (API only, ``--data-parallel-size 2
--data-parallel-size-local 0``) and two ``engine-core --headless`` commands,
one rank each, that connect to it over ``tcp://127.0.0.1``. Requests go
through the official ``openai`` client (or raw HTTP where the test needs the
bytes). The SIGKILL test damages the stack, so it runs last. (``weft
serve`` launching its own local engine cores is exercised by
tests/bench/test_bench_serve.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from services.api.server import _local_ranks_and_handshake
from services.api.server import build_parser as serve_parser
from services.api.server import main as serve_main
from services.model_files import resolve
from services.ports import free_port
from tests.polling import wait_for, wait_healthy

pytestmark = pytest.mark.slow

MODEL = resolve(None)
STARTUP_DEADLINE_S = 180.0
ENGINE_ARGS = ["--dtype", "float32", "--max-num-batched-tokens", "512"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


class Stack:
    def __init__(self, log_dir: Path) -> None:
        self.port, rpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        dp = [
            "--data-parallel-size",
            "2",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(rpc_port),
        ]
        data_ports = [
            "--data-parallel-input-port",
            str(free_port()),
            "--data-parallel-output-port",
            str(free_port()),
        ]
        self.api = self._start(
            "api",
            [
                "services.cli",
                "serve",
                "--model",
                str(MODEL.weights),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--data-parallel-size-local",
                "0",
                *dp,
                *data_ports,
                *ENGINE_ARGS,
            ],
        )
        # engine-core takes no engine args: the config arrives in the handshake.
        self.engine_cores = [
            self._start(
                f"engine-core-{rank}",
                [
                    "services.engine_core.cli",
                    "--headless",
                    "--dp-start-rank",
                    str(rank),
                    "--data-parallel-size-local",
                    "1",
                    *dp,
                ],
            )
            for rank in range(2)
        ]

    def _start(self, name: str, module_argv: list[str]) -> subprocess.Popen:
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        # Own session: teardown kills the whole group, children included. The
        # child keeps the log open; this process closes its copy at once.
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", *module_argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self.processes.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def wait_healthy(self) -> None:
        def alive() -> None:
            exited = [p.args for p in self.processes if p.poll() is not None]
            assert not exited, f"{exited} exited during start-up:\n{self.logs()}"

        wait_healthy(self.url, STARTUP_DEADLINE_S, alive, self.logs)

    def kill(self) -> None:
        for proc in self.processes:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=5)

    def ranks(self) -> dict[int, dict]:
        return {r["rank"]: r for r in self.health().json()["ranks"]}

    def engine_process(self, rank: int) -> psutil.Process:
        """The engine-core process of ``rank`` (a child of its ``engine-core`` command)."""
        (child,) = psutil.Process(self.engine_cores[rank].pid).children()
        return child


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("stack-logs"))
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.kill()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_until_idle(stack: Stack, ranks=(0, 1), deadline_s: float = 15.0) -> dict[int, dict]:
    """Poll /health until ``ranks`` run nothing and every KV block is free."""

    def idle() -> dict | None:
        state = stack.ranks()
        return (
            state
            if all(
                state[r]["num_running"] == 0
                and state[r]["num_waiting"] == 0
                and state[r]["num_free_blocks"] == state[r]["num_blocks"] - 1
                for r in ranks
            )
            else None
        )

    try:
        return wait_for(idle, deadline_s, f"ranks {ranks} idle with every KV block free")
    except AssertionError as e:
        raise AssertionError(f"{e}: {stack.ranks()}") from None


def serve_layout(*argv: str) -> tuple[int, str]:
    args = serve_parser().parse_args(list(argv))
    return _local_ranks_and_handshake(args, args.data_parallel_size)


def test_serve_picks_local_ranks_and_the_handshake_address():
    assert serve_layout("--data-parallel-size", "2")[0] == 2
    assert serve_layout("--data-parallel-size", "2")[1].startswith("ipc://")  # all ranks here
    local, address = serve_layout(
        "--data-parallel-size", "2", "--data-parallel-size-local", "0", "--data-parallel-rpc-port", "0"
    )
    assert local == 0 and address.startswith("tcp://127.0.0.1:") and not address.endswith(":*")
    local, _ = serve_layout("--data-parallel-size", "3", "--data-parallel-start-rank", "1")
    assert local == 2
    with pytest.raises(ValueError, match="do not fit"):
        serve_layout(
            "--data-parallel-size", "2", "--data-parallel-start-rank", "1", "--data-parallel-size-local", "2"
        )


def test_serve_refuses_a_bad_layout_before_starting_anything(capsys):
    assert serve_main(["--data-parallel-size", "1", "--data-parallel-size-local", "2"]) == 2
    assert "do not fit" in capsys.readouterr().err


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list().data] == [MODEL.name]
    body = stack.health().json()
    assert body["status"] == "ok" and body["ready"] == [0, 1]
    assert all(r["num_blocks"] > 1 for r in body["ranks"])


def test_the_api_process_never_loads_torch(stack):
    maps = Path(f"/proc/{stack.api.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps
    code = "import sys, services.cli, services.api.server; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_completion_n2_with_logprobs(client):
    response = client.completions.create(
        model=MODEL.name, prompt=PROMPTS[0], max_tokens=6, n=2, temperature=0.8, seed=1, logprobs=2
    )
    assert len(response.choices) == 2 and {c.index for c in response.choices} == {0, 1}
    for choice in response.choices:
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == 6 == len(choice.logprobs.token_logprobs)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert response.usage.completion_tokens == 12 and response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_chat_with_top_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL.name,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = response.choices[0]
    assert response.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert all(len(item.top_logprobs) == 2 for item in choice.logprobs.content)


def test_streaming_completion_with_usage(client):
    stream = client.completions.create(
        model=MODEL.name,
        prompt=PROMPTS[1],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *token_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert token_chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in token_chunks)
    plain = client.completions.create(model=MODEL.name, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert text == plain.choices[0].text


def test_streaming_chat_n2_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL.name,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=6,
        n=2,
        temperature=0.7,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    roles = {c.choices[0].index: c.choices[0].delta.role for c in chunks[:-1] if c.choices[0].delta.role}
    assert roles == {0: "assistant", 1: "assistant"}
    finished = {c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_string(client):
    greedy = (
        client.completions.create(model=MODEL.name, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    stop = greedy.strip()[2:5]  # a few characters in the middle of the text
    assert stop
    stopped = client.completions.create(
        model=MODEL.name, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop]
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == greedy[: greedy.index(stop)]
    streamed = client.completions.create(
        model=MODEL.name, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == stopped.text


def test_greedy_text_equals_offline_generate(client):
    from services import LLM, SamplingParams

    served = [
        client.completions.create(model=MODEL.name, prompt=p, max_tokens=16, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    # The servers' engine arguments; a fixed pool (the pool's size changes no greedy token)
    # instead of profiling one.
    llm = LLM(
        str(MODEL.weights),
        dtype="float32",
        max_num_batched_tokens=512,
        num_threads=1,
        num_gpu_blocks_override=600,
        block_size=16,
    )
    try:
        offline = [
            llm.generate(p, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
            for p in PROMPTS
        ]
    finally:
        llm.shutdown()
    assert served == offline


def test_64_concurrent_streams_spread_over_both_ranks(stack):
    before = stack.ranks()

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        stream = await aclient.completions.create(
            model=MODEL.name,
            prompt=f"Item {i}: the",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finishes = [c.choices[0].finish_reason async for c in stream if c.choices]
        return finishes[-1]

    async def all_of_them() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))
        finally:
            await aclient.close()

    assert asyncio.run(all_of_them()) == ["length"] * 64
    after = wait_until_idle(stack)
    routed = [after[r]["num_routed"] - before[r]["num_routed"] for r in (0, 1)]
    # Balancing is by load (requests in flight), not round robin: a rank whose engine gets more of
    # the two shared cores finishes its 8-token requests sooner and is sent more (25 / 39 seen).
    # Both must still take a real share of the 64.
    assert sum(routed) == 64 and all(n >= 64 // 4 for n in routed), routed


def test_disconnecting_a_stream_aborts_it(stack):
    body = {
        "model": MODEL.name,
        "prompt": PROMPTS[0],
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", stack.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            wait_for(
                lambda: sum(r["num_running"] for r in stack.ranks().values()) == 1, 10, "the request to run"
            )
        # Leaving the block closes the connection mid-stream.
    wait_until_idle(stack)


def _stream_until_end(url: str, body: dict, events: list) -> None:
    """Read one SSE stream to its end, noting each event and when it came;
    a connection cut by teardown just ends it."""
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line[len("data: ") :]))
    except httpx.TransportError:
        pass


def _ended(streams: list[list]) -> list | None:
    return next((events for events in streams if events and events[-1][1] == "[DONE]"), None)


def test_sigkill_of_one_engine_fails_its_requests_and_the_other_serves(stack):
    before = stack.ranks()
    body = {
        "model": MODEL.name,
        "prompt": PROMPTS[1],
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    streams: list[list] = [[], []]
    threads = [
        threading.Thread(target=_stream_until_end, args=(stack.url + "/v1/completions", body, events))
        for events in streams
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(
            lambda: all(streams) and sum(r["num_running"] for r in stack.ranks().values()) >= 2,
            30,
            "both streams to run",
        )
        routed = [stack.ranks()[r]["num_routed"] - before[r]["num_routed"] for r in (0, 1)]
        assert routed == [1, 1]  # one endless stream on each rank

        stack.engine_process(1).kill()  # SIGKILL
        killed_at = time.monotonic()
        failed = wait_for(lambda: _ended(streams), 10, "the killed rank's stream to end", interval_s=0.05)
        assert failed is not None and failed[-1][0] - killed_at < 5.0, "the killed rank's stream hung"
        error = json.loads(failed[-2][1])["error"]
        assert error["code"] == 500 and "rank 1" in error["message"]

        survivor = next(events for events in streams if events is not failed)
        seen = len(survivor)
        health = stack.health()
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert health.json()["dead"] == [1] and health.json()["ready"] == [0]
        # New requests all go to the surviving rank, and succeed.
        for prompt in PROMPTS:
            response = httpx.post(
                stack.url + "/v1/completions",
                timeout=60,
                json={"model": MODEL.name, "prompt": prompt, "max_tokens": 4},
            )
            assert response.status_code == 200, response.text
        after = stack.ranks()
        assert after[1]["num_routed"] == before[1]["num_routed"] + 1
        assert after[0]["num_routed"] == before[0]["num_routed"] + 1 + len(PROMPTS)
        assert len(survivor) > seen and survivor[-1][1] != "[DONE]"  # it kept streaming
        assert stack.api.poll() is None
    finally:
        stack.kill()  # also ends the survivor's endless stream
        for thread in threads:
            thread.join(timeout=30)
