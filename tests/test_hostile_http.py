"""The real stack against hostile HTTP: 2,000 fuzzed requests, then overload.

One ``weft serve`` (one engine core running a tiny random Llama, so valid
requests cost milliseconds) with small limits: 4 running + 4 waiting
sequences, ``--max-n 4``, a 64 KiB body cap and two API keys (one read
from a file). The fuzz sends random and malformed requests to every route:
no answer may be a 5xx other than 503, every error must be OpenAI-shaped,
no process may die, and no KV block may stay in use. Then 4x more concurrent requests than the engine
admits: the excess gets 503 at once, the rest complete, nothing leaks.
Last, the single requests meant to stall or break the API process (deep
nesting, a pathological grammar, huge stop lists, a trickled body) are
refused while the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.stack import Stack
from tests.api.test_app_fuzz import FIELDS, MODEL_NAME, field_changes, json_values
from tests.polling import wait_for
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.slow

KEYS = ["first-key", "second-key"]
MAX_NUM_SEQS = MAX_WAITING = 4
CAPACITY = MAX_NUM_SEQS + MAX_WAITING
MAX_BODY = 65536
BODY_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny"))
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# the second key comes from a file, out of `ps`\n{KEYS[1]}\n")
    stack = Stack(
        [
            "--model",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--data-parallel-size",
            "1",
            "--num-gpu-blocks-override",
            "128",
            "--block-size",
            "16",
            "--max-model-len",
            "160",
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-waiting-requests",
            str(MAX_WAITING),
            "--max-n",
            "4",
            "--max-request-body-bytes",
            str(MAX_BODY),
            "--api-key",
            KEYS[0],
            "--api-key-file",
            str(key_file),
            "--body-timeout",
            str(BODY_TIMEOUT_S),
            # Bodies carry both endpoints' prompt fields (see tests/api/test_app_fuzz.py).
            "--allow-unknown-fields",
        ],
        tmp_path_factory.mktemp("logs"),
        startup_timeout_s=120,
    )
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.kill()


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


def wait_idle(stack: Stack, timeout_s: float = 20.0) -> dict:
    """Every rank ready and idle, every KV block free, nothing admitted."""

    def idle() -> dict | None:
        health = stack.health()
        return (
            health
            if health["admitted"] == 0
            and all(
                r["state"] == "ready"
                and r["num_running"] == r["num_waiting"] == r["num_in_flight"] == 0
                and r["num_free_blocks"] == r["num_blocks"] - 1
                for r in health["ranks"]
            )
            else None
        )

    try:
        return wait_for(idle, timeout_s, "every rank ready and idle with every KV block free")
    except AssertionError as e:
        raise AssertionError(f"{e}: {stack.health()}") from None


# ---- the fuzz

# Valid requests cost engine time: keep them short (the junk branch still tries any value).
_small = {
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.integers(1, 3),
    "n": st.integers(1, 5),
    "prompt": st.text(min_size=1, max_size=30)
    | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
    | st.lists(st.integers(-5, 60000), max_size=4),
}
_fields = {**FIELDS, **_small}
_names = sorted(_fields)
_VALID = {
    "model": MODEL_NAME,
    "prompt": "Hello",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 2,
}
_changes = field_changes(_fields)
_junk = json_values | st.integers(-(10**20), 10**20) | st.text(max_size=20)


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


_bodies = st.one_of(
    st.builds(lambda c: _json({**_VALID, **c}), _changes),
    st.builds(lambda c, k, j: _json({**_VALID, **c, k: j}), _changes, st.sampled_from(_names), _junk),
    json_values.map(_json),
    st.binary(max_size=80),
    st.sampled_from(
        [
            b'{"prompt": "x", "temperature": NaN}',
            b"[" * 5000 + b"]" * 5000,
            _json({**_VALID, "prompt": "y" * (MAX_BODY + 1)}),
            _json({**_VALID, "n": 10**9}),
            _json({**_VALID, "max_tokens": 10**12}),
            _json({**_VALID, "prompt": list(range(500))}),
        ]
    ),
)
_POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
_requests = st.one_of(
    st.tuples(st.just("POST"), st.sampled_from(_POSTS), _bodies),
    st.tuples(
        st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
        st.sampled_from([*_POSTS, "/v1/models", "/health", "/version", "/v1", "/v1/x", "/../etc"]),
        st.just(b""),
    ),
)
_auth = st.sampled_from([f"Bearer {KEYS[0]}", f"Bearer {KEYS[1]}", f"Bearer {KEYS[1]}"[:-1], "", "Basic x"])


_GENERATE = {"/v1/completions", "/v1/chat/completions"}
_answered = {"generated": 0}  # fuzzed generation requests answered 200: each reached the engine


def check_answer(response: httpx.Response) -> None:
    status = response.status_code
    assert status < 500 or status == 503, response.text
    assert "Traceback" not in response.text
    if status >= 400:
        error = response.json()["error"]
        assert error["code"] == status and error["message"] and error["type"]
        if status == 503:
            assert "Retry-After" in response.headers
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in map(json.loads, events[:-1]):
            if "error" in event:  # failed mid-stream: told in the stream, OpenAI-shaped
                assert event["error"]["code"] < 500 and event["error"]["message"]


def test_engine_pids(stack):
    """First: remember the processes the fuzz must not kill."""
    stack.fuzz_pids = (stack.api.pid, [e.pid for e in stack.engines()])
    assert len(stack.fuzz_pids[1]) == 1


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=_requests, authorization=_auth)
def test_fuzzed_requests_get_no_5xx_and_openai_errors(http, request, authorization):
    method, path, body = request
    headers = {"content-type": "application/json"}
    if authorization:
        headers["authorization"] = authorization
    response = http.request(method, path, content=body, headers=headers)
    check_answer(response)
    _answered["generated"] += response.status_code == 200 and path in _GENERATE


def test_after_the_fuzz_every_process_serves_and_no_block_leaked(stack, http):
    api_pid, engine_pids = stack.fuzz_pids
    assert stack.api.poll() is None and [e.pid for e in stack.engines()] == engine_pids
    # The fuzz reached the engine: each generation answered 200 was routed.
    generated = _answered["generated"]
    assert generated >= 50 and stack.health()["ranks"][0]["num_routed"] >= generated
    response = http.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3},
        headers={"authorization": f"Bearer {KEYS[0]}"},
    )
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(stack)


def test_overload_gets_quick_503s_and_the_admitted_complete(stack):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float, httpx.Response]:
        body = {"model": MODEL_NAME, "prompt": f"Request {i}:", "max_tokens": 120, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        return i, time.monotonic(), response

    async def burst():
        headers = {"authorization": f"Bearer {KEYS[1]}"}
        limits = httpx.Limits(max_connections=4 * CAPACITY)
        async with httpx.AsyncClient(
            base_url=stack.url, headers=headers, timeout=120, limits=limits
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(4 * CAPACITY)))

    results = asyncio.run(burst())
    done = [(t, r) for _, t, r in results if r.status_code == 200]
    refused = [(t, r) for _, t, r in results if r.status_code == 503]
    assert len(done) == CAPACITY and len(refused) == 3 * CAPACITY, [r.status_code for _, _, r in results]
    # Quickly: every refusal came back before the first admitted request finished.
    assert max(t for t, _ in refused) < min(t for t, _ in done)
    for _, response in refused:
        assert response.headers["Retry-After"] == "1" and "overloaded" in response.json()["error"]["message"]
    for _, response in done:
        assert response.json()["usage"]["completion_tokens"] == 120
    health = wait_idle(stack)
    assert health["capacity"] == CAPACITY


# ---- single hostile requests

_AUTH = {"authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"}
_DEEP = b"[" * 5000 + b"]" * 5000
_HOSTILE = [
    ("/v1/completions", b'{"prompt": "Hi", "x": ' + _DEEP + b"}", 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "x": ' + _DEEP + b"}", 400),
    ("/tokenize", b'{"prompt": "Hi", "x": ' + _DEEP + b"}", 400),
    ("/detokenize", b'{"tokens": ' + _DEEP + b"}", 400),
    ("/v1/completions", _json({**_VALID, "guided_grammar": "expr: NUMBER" + "\n" * 25_000}), 400),
    ("/v1/completions", _json({**_VALID, "stop": [f"s{i}" for i in range(1000)]}), 400),
    ("/v1/completions", _json({**_VALID, "stop_token_ids": list(range(5000))}), 400),
]


async def _trickled_post(port: int) -> tuple[bytes, int]:
    """A body sent a byte at a time: the answer (read to EOF) and how many bytes went."""
    body = b'{"prompt": "' + b"x" * 5000 + b'"}'
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        b"POST /tokenize HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    )
    writer.write(head % (KEYS[0].encode(), len(body)))

    async def trickle() -> int:
        sent = 0
        with contextlib.suppress(ConnectionError):
            for byte in body:
                writer.write(bytes([byte]))
                await writer.drain()
                sent += 1
                await asyncio.sleep(BODY_TIMEOUT_S / 40)  # the attack's pace, not a wait for anything
        return sent

    trickler = asyncio.create_task(trickle())
    answer = b""
    # The server answers and closes while bytes are still on their way: its TCP then resets the
    # connection, which would throw away an answer read whole; read it as it comes instead.
    with contextlib.suppress(ConnectionResetError):
        while chunk := await asyncio.wait_for(reader.read(4096), 120):
            answer += chunk
    sent = await asyncio.wait_for(trickler, 120)
    writer.close()
    return answer, sent


def test_single_hostile_requests_are_refused_and_the_server_keeps_serving(stack, http):
    api_pid = stack.api.pid
    for path, body, status in _HOSTILE:
        response = http.post(path, content=body, headers=_AUTH)
        assert response.status_code == status, (path, response.text)
        check_answer(response)
    # The tokenizer routes want the key too.
    assert http.post("/tokenize", json={"prompt": "Hi"}).status_code == 401
    answer, sent = asyncio.run(_trickled_post(httpx.URL(stack.url).port))
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert sent < 2500  # cut off at the deadline, not waited for
    response = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3}, headers=_AUTH
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert stack.api.poll() is None and stack.api.pid == api_pid
    wait_idle(stack)
