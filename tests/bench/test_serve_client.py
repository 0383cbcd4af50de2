"""`weft bench serve --base-url` against a stub OpenAI-compatible server (not weft's):
the client, its report, goodput, failures, chat streams without usage, and a sweep with its plot."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.bench import cli

FAIL_MAX_TOKENS = 7  # the stub answers HTTP 500 to requests asking for this many tokens


def _stub_app(bodies: list[dict[str, Any]]) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def complete(request: Request) -> Response:
        body = await request.json()
        bodies.append(body)
        if body["max_tokens"] == FAIL_MAX_TOKENS:
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=500)
        chat = request.url.path.endswith("/chat/completions")

        async def events() -> Any:
            if chat:
                yield _event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0)  # let other streams interleave
                choice = (
                    {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
                )
                yield _event({"choices": [choice]})
            if not chat:  # the chat stub sends no usage: the client counts chunks
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
                yield _event({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def reset_prefix_cache(request: Request) -> Response:
        bodies.append({"reset_prefix_cache": True})
        return JSONResponse({"reset": True})

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/v1/chat/completions", complete, methods=["POST"]),
        ]
    )


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


@pytest.fixture
def stub() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    bodies: list[dict[str, Any]] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # listening before the thread starts: clients queue instead of racing start-up
    server = uvicorn.Server(uvicorn.Config(_stub_app(bodies), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", bodies
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def _workload(path: Path, max_tokens: list[int]) -> str:
    requests = [
        {"prompt": f"word {i}", "prompt_token_ids": list(range(1, 3 + i)), "max_tokens": n}
        for i, n in enumerate(max_tokens)
    ]
    path.write_text(json.dumps({"name": "tiny", "requests": requests}))
    return str(path)


def _check_stats(report: dict[str, Any]) -> None:
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = report[name]
        assert 0 <= s["median"] <= s["p90"] <= s["p99"], name
        assert s["mean"] >= 0
    assert report["ttft_ms"]["mean"] <= report["e2el_ms"]["mean"]
    assert report["ttft_ms"]["p99"] <= report["e2el_ms"]["p99"]


def test_completions_against_the_stub(tmp_path: Path, stub: tuple[str, list]) -> None:
    url, bodies = stub
    out = tmp_path / "result.json"
    argv = [
        "serve",
        "--base-url",
        url,
        "--dataset",
        _workload(tmp_path / "w.json", [3, 5, 2, 1]),
        "--request-rate",
        "200",
        "--max-concurrency",
        "2",
        "--goodput",
        "ttft:60000",
        "tpot:60000",
        "--seed",
        "1",
        "--quiet",
        "--result-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (4, 0)
    assert report["total_output_tokens"] == 11 and report["total_input_tokens"] == 2 + 3 + 4 + 5
    assert report["model"] == "stub-model"  # found through /v1/models
    assert report["duration_s"] > 0 and report["output_throughput"] == pytest.approx(
        11 / report["duration_s"]
    )
    assert report["request_throughput"] > 0 and report["total_token_throughput"] > report["output_throughput"]
    assert report["good_requests"] == 4 and report["request_goodput"] == pytest.approx(
        report["request_throughput"]
    )
    _check_stats(report)
    assert len(bodies) == 4 and all(b["ignore_eos"] and b["stream"] for b in bodies)
    assert sorted(b["prompt"] for b in bodies)[0] == [1, 2]  # token ids, exactly


def test_chat_without_usage_and_a_failure(
    tmp_path: Path, stub: tuple[str, list], capsys: pytest.CaptureFixture[str]
) -> None:
    url, bodies = stub
    out = tmp_path / "result.json"
    argv = [
        "serve",
        "--base-url",
        url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        "anything",
        "--dataset",
        _workload(tmp_path / "w.json", [4, FAIL_MAX_TOKENS, 2]),
        "--quiet",
        "--output-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (2, 1)
    assert report["total_output_tokens"] == 6  # counted from the content chunks
    assert "HTTP 500" in report["errors"][0]
    assert bodies[0]["model"] == "anything" and bodies[0]["messages"][0]["role"] == "user"
    _check_stats(report)
    assert "successful requests: 2" in capsys.readouterr().out


def test_concurrency_sweep_writes_a_plot(tmp_path: Path, stub: tuple[str, list]) -> None:
    url, _ = stub
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = [
        "serve",
        "--base-url",
        url,
        "--dataset",
        _workload(tmp_path / "w.json", [3, 3, 3]),
        "--sweep",
        "concurrencies",
        "1",
        "3",
        "--plot",
        str(plot),
        "--quiet",
        "--result-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert [run["prefix_cache_reset"] for run in report["runs"]] == [True, True]
    assert [run["swept_value"] for run in report["runs"]] == [1, 3]
    assert [run["max_concurrency"] for run in report["runs"]] == [1, 3]
    assert all(run["completed"] == 3 and run["total_output_tokens"] == 9 for run in report["runs"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_without_base_url_runs_every_point_through_one_launched_server(
    tmp_path: Path,
    stub: tuple[str, list],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, bodies = stub
    launches = []

    @contextlib.contextmanager
    def stand_in(engine_args, model_name, workload):  # the stub plays the `weft serve` started here
        launches.append((engine_args, model_name, len(workload.requests)))
        yield types.SimpleNamespace(url=url)

    monkeypatch.setattr("benchmarks.bench.serve.launched_server", stand_in)
    out = tmp_path / "sweep.json"
    argv = [
        "serve",
        "--dataset",
        _workload(tmp_path / "w.json", [2, 2, 2, 2]),
        "--sweep",
        "concurrencies",
        "1",
        "4",
        "--max-num-partial-prefills",
        "4",
        "--plot",
        str(tmp_path / "sweep.png"),
        "--quiet",
        "--result-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    ((engine_args, model_name, num_requests),) = launches  # one server for the whole sweep
    assert engine_args.max_num_partial_prefills == 4 and num_requests == 4
    # Before each point the cache is reset, so no point reads the prompts of the previous one.
    resets = [i for i, body in enumerate(bodies) if "reset_prefix_cache" in body]
    assert resets == [0, 5]
    requests = [body for body in bodies if "model" in body]
    assert all(body["model"] == model_name for body in requests) and len(requests) == 8
    report = json.loads(out.read_text())
    assert report["engine_args"]["max_num_partial_prefills"] == 4
    assert [p["value"] for p in report["points"]] == [1, 4]
    for point, run in zip(report["points"], report["runs"]):
        assert point["output_tok_s"] == run["output_throughput"] == 8 / run["duration_s"]
        assert (
            point["ttft_p99_ms"] == run["ttft_ms"]["p99"] and point["itl_p50_ms"] == run["itl_ms"]["median"]
        )
    table = capsys.readouterr().out
    assert "concurrency  out tok/s" in table


def test_a_launched_sweep_stops_when_the_cache_is_not_reset(
    tmp_path: Path, stub: tuple[str, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, bodies = stub

    @contextlib.contextmanager
    def stand_in(engine_args, model_name, workload):
        yield types.SimpleNamespace(url=url)

    monkeypatch.setattr("benchmarks.bench.serve.launched_server", stand_in)
    monkeypatch.setattr(
        "benchmarks.bench.serve_cli.reset_prefix_cache", lambda base_url, admin_key=None: False
    )
    argv = ["serve", "--dataset", _workload(tmp_path / "w.json", [2]), "--sweep", "concurrencies", "1"]
    with pytest.raises(RuntimeError, match="did not reset its prefix cache"):
        cli.main([*argv, "--quiet", "--plot", str(tmp_path / "p.png")])
    assert bodies == []  # no point ran on a warm cache


@pytest.mark.parametrize(
    "extra, why",
    [
        (["--goodput", "ttft"], "--goodput takes NAME:MS"),
        (["--sweep", "rates"], "--sweep takes"),
        (["--sweep", "concurrencies", "1.5"], "whole numbers"),
        (["--request-rate", "0"], "--request-rate must be positive"),
        (["--endpoint", "/v1/embeddings"], "invalid choice"),
        ([], "cannot list the models"),  # nothing listens on the discard port
    ],
)
def test_bad_client_arguments(
    extra: list[str], why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "serve",
        "--base-url",
        "http://127.0.0.1:9",
        "--dataset",
        _workload(tmp_path / "w.json", [1]),
        *extra,
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err


class _DroppingServer:
    """A raw HTTP server whose first ``drops`` connections read a request and close without a byte
    of response (a kept-alive connection the server had already closed, as httpx sees it), and whose
    later ones stream a two-token completion; ``cut`` instead sends the response's head and closes."""

    def __init__(self, drops: int, cut: bool = False) -> None:
        self.drops, self.cut, self.connections = drops, cut, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed by the test
            with conn:
                self.connections += 1
                request = b""
                while (chunk := conn.recv(65536)) and not _whole_request(request := request + chunk):
                    pass
                if self.connections <= self.drops:
                    continue  # close with nothing sent
                events = "".join(_event({"choices": [{"index": 0, "text": f" t{i}"}]}) for i in range(2))
                events += "data: [DONE]\n\n"
                head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                conn.sendall(head if self.cut else head + events.encode())

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (closing alone would not)
        self.sock.close()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()


def _whole_request(data: bytes) -> bool:
    """Whether ``data`` holds a request's head and all of the body its content-length announces."""
    head, found, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return bool(found) and len(body) >= (int(length.group(1)) if length else 0)


def _send_one(url: str):
    import httpx

    from benchmarks.bench.serve_client import ClientConfig, send_one
    from benchmarks.bench.workload import WorkloadRequest

    async def go():
        async with httpx.AsyncClient(timeout=30) as http:
            config = ClientConfig(base_url=url, model="m")
            return await send_one(
                http, config, WorkloadRequest(prompt="hi", prompt_token_ids=[1, 2], max_tokens=2)
            )

    return asyncio.run(go())


@pytest.mark.parametrize("drops,ok,connections", [(1, True, 2), (2, False, 2)])
def test_a_connection_dropped_before_any_response_is_retried_once(drops, ok, connections):
    server = _DroppingServer(drops)
    try:
        record = _send_one(server.url)
    finally:
        server.close()
    assert server.connections == connections
    assert record.ok == ok
    if ok:
        assert record.output_tokens == 2 and len(record.chunk_times) == 2
    else:
        assert "RemoteProtocolError" in record.error


def test_a_response_cut_after_its_head_is_not_retried():
    server = _DroppingServer(drops=0, cut=True)
    try:
        record = _send_one(server.url)
    finally:
        server.close()
    assert server.connections == 1 and not record.ok
