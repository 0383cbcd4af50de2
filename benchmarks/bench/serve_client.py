"""An async streaming client for any OpenAI-compatible server.

Sends a workload's requests at a Poisson rate (``inf``: all at once), at most
``max_concurrency`` in flight, each as a streaming completion (or chat
completion) with ``ignore_eos`` so output lengths are exact, and records
per-request timestamps for ``metrics.summarize``. Nothing here is weft-specific:
the tests run it against a stub server too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.bench.metrics import RequestRecord, summarize
from benchmarks.bench.workload import Workload, WorkloadRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf  # requests per second; inf sends everything at t=0
    max_concurrency: int | None = None
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}.")
        if self.request_rate <= 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}.")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}.")


def request_body(config: ClientConfig, request: WorkloadRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        # Token ids make the prompt exact on weft and vLLM; text would re-tokenize.
        body["prompt"] = request.prompt_token_ids
    return body


def _chunk_text(chunk: dict[str, Any]) -> str | None:
    """The content a choice chunk carries (None for role-only or usage chunks)."""
    if not chunk.get("choices"):
        return None
    choice = chunk["choices"][0]
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
    return text or None


async def send_one(http: Any, config: ClientConfig, request: WorkloadRequest) -> RequestRecord:
    """Stream one request; a failure is recorded, not raised.

    A kept-alive connection the server closed while it sat in the pool fails before any response
    comes (httpx's RemoteProtocolError, "Server disconnected without sending a response": llama.cpp's
    server does it now and then); such a request is sent once more on a new connection, its times
    still counted from the first send. A failure after the response began is never retried."""
    import httpx

    sent = time.perf_counter()
    for attempt in (1, 2):
        chunk_times: list[float] = []
        usage_tokens = None
        responded = False
        try:
            async with http.stream(
                "POST", config.base_url + config.endpoint, json=request_body(config, request)
            ) as response:
                responded = True
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        raise RuntimeError(f"stream failed: {chunk['error']}")
                    if _chunk_text(chunk) is not None:
                        chunk_times.append(time.perf_counter())
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
            ended = time.perf_counter()
            break
        except Exception as e:  # noqa: BLE001 - any failure counts as a failed request
            if attempt == 1 and not responded and isinstance(e, httpx.RemoteProtocolError):
                continue
            return RequestRecord(len(request.prompt_token_ids), 0, sent, error=f"{type(e).__name__}: {e}")
    # Servers without usage chunks: one token per chunk is the best guess.
    tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    error = None if chunk_times else "no output"
    return RequestRecord(len(request.prompt_token_ids), tokens, sent, chunk_times, ended, error)


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Send times from t=0 of a Poisson process at ``rate`` per second."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in range(num):
        delays.append(t)
        t += rng.expovariate(rate)
    return delays


async def run_benchmark(
    config: ClientConfig, workload: Workload, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """Send the whole workload and return ``metrics.summarize``'s report plus the settings."""
    import httpx
    from tqdm import tqdm

    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    connections = config.max_concurrency or len(workload.requests)
    progress = tqdm(total=len(workload.requests), disable=config.quiet, desc="requests")
    delays = arrival_delays(len(workload.requests), config.request_rate, config.seed)

    async def scheduled(http: Any, delay: float, request: WorkloadRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))  # Poisson arrival
        async with limit:
            record = await send_one(http, config, request)
        progress.update(1)
        return record

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        start = time.perf_counter()
        records = await asyncio.gather(*(scheduled(http, d, r) for d, r in zip(delays, workload.requests)))
        duration = time.perf_counter() - start
    progress.close()
    report = summarize(list(records), duration, slos)
    report |= {
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "max_concurrency": config.max_concurrency,
        "endpoint": config.endpoint,
        "model": config.model,
        "num_prompts": len(workload.requests),
    }
    return report


def served_model(base_url: str) -> str:
    """The first model ``/v1/models`` lists."""
    import httpx

    response = httpx.get(base_url + "/v1/models", timeout=30)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model.")
    return models[0]["id"]


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"successful requests: {report['completed']}   failed: {report['failed']}",
        f"duration (s): {report['duration_s']:.2f}   request rate: {report['request_rate']}"
        f"   max concurrency: {report['max_concurrency']}",
        f"input tokens: {report['total_input_tokens']}   output tokens: {report['total_output_tokens']}",
        f"request throughput (req/s): {report['request_throughput']:.2f}",
        f"output token throughput (tok/s): {report['output_throughput']:.1f}",
        f"total token throughput (tok/s): {report['total_token_throughput']:.1f}",
    ]
    if "request_goodput" in report:
        lines.append(
            f"request goodput (req/s): {report['request_goodput']:.2f} "
            f"({report['good_requests']} met {report['goodput_slos_ms']})"
        )
    lines.append(f"{'ms':<6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = report[f"{name}_ms"]
        lines.append(
            f"{name.upper():<6}{s['mean']:>10.1f}{s['median']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}"
        )
    return "\n".join(lines)


def plot_sweep(runs: list[dict[str, Any]], swept: str, path: str) -> None:
    """Output throughput vs median latency, one point per swept value."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    throughput = [run["output_throughput"] for run in runs]
    for metric, label in (("e2el_ms", "E2E latency"), ("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        axis.plot(throughput, [run[metric]["median"] for run in runs], marker="o", label=f"median {label}")
    for run, x in zip(runs, throughput):
        axis.annotate(str(run["swept_value"]), (x, run["e2el_ms"]["median"]), fontsize=8)
    axis.set_xlabel("output tokens/s")
    axis.set_ylabel("latency (ms)")
    axis.set_title(f"throughput vs latency over {swept}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
