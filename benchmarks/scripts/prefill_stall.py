"""How long one long prompt holds up a running stream, and what its chunking costs the prompt.

Starts ``weft serve`` on MODEL once per setting of ``--long-prefill-token-threshold`` (``auto``:
not given), streams one request (its prompt short, ``--stream-tokens`` new tokens, ``ignore_eos``),
and once that stream has its first tokens sends a prompt of ``--prompt-tokens`` tokens asking for
one (``--prompts``: that many such prompts at once, different tokens each). Reports per setting: the
stream's longest gap between two tokens while the prompts were in (how long a step holding their
chunks kept it waiting) and its median gap until then, and the time to the last prompt's first
token. The settings run one after the other on this machine (compare within a run); prefix caching
is off so every run prefills the whole prompt.

    python benchmarks/scripts/prefill_stall.py --model llama-3.2-1b-q4_k_m.gguf --settings auto 0
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _wait_healthy(client: httpx.AsyncClient, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weft serve exited with {proc.returncode} before it was healthy")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"weft serve was not healthy within {timeout} s")


async def _stream(client: httpx.AsyncClient, model: str, prompt: list[int], tokens: int, times: list[float]):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())


async def _one_setting(args, setting: str) -> dict:
    port = _free_port()
    command = [sys.executable, "-m", "services.cli", "serve", "--model", args.model, "--port", str(port)]
    command += ["--max-model-len", str(args.max_model_len), "--no-enable-prefix-caching"]
    if setting != "auto":
        command += ["--long-prefill-token-threshold", setting]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy()
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None) as client:
            await _wait_healthy(client, proc, args.start_timeout)
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            stream_times: list[float] = []
            stream = asyncio.create_task(
                _stream(
                    client,
                    model,
                    [(7 * i + 101) % 30000 + 100 for i in range(16)],
                    args.stream_tokens,
                    stream_times,
                )
            )
            while len(stream_times) < 4:  # the stream is decoding
                if stream.done():
                    stream.result()
                    raise RuntimeError("the stream ended before it decoded")
                await asyncio.sleep(0.05)
            sent = time.monotonic()
            firsts: list[list[float]] = [[] for _ in range(args.prompts)]
            await asyncio.gather(
                *(
                    _stream(
                        client,
                        model,
                        [(37 * i + 11 + 997 * k) % 30000 + 100 for i in range(args.prompt_tokens)],
                        1,
                        t,
                    )
                    for k, t in enumerate(firsts)
                )
            )
            first_token = max(t[0] for t in firsts)  # the last prompt's first token
            while stream_times[-1] <= first_token:  # the gap the prompt's last step held it in, closed
                if stream.done():
                    stream.result()
                    raise RuntimeError(
                        "the stream ended before the prompt's first token: raise --stream-tokens"
                    )
                await asyncio.sleep(0.05)
            stream.cancel()  # the server aborts it when the connection goes
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    during = [b - a for a, b in zip(stream_times, stream_times[1:]) if b > sent and a < first_token]
    gaps = [b - a for a, b in zip(stream_times, stream_times[1:]) if a < first_token]
    return {
        "setting": setting,
        "stream_max_gap_s": max(during) if during else float("nan"),
        "stream_median_gap_s": statistics.median(gaps),
        "prompt_ttft_s": first_token - sent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--settings", nargs="+", default=["auto", "0"], help="auto, or a threshold (0: no cap)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument(
        "--prompts", type=int, default=1, help="long prompts sent at once (TTFT: the last one's first token)"
    )
    parser.add_argument("--stream-tokens", type=int, default=2000, help="enough to outlast the long prefill")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args()
    print(
        "| threshold | stream's longest gap while the prompts were in | stream's median gap | (last) prompt's TTFT |"
    )
    print("|---|---|---|---|")
    for setting in args.settings:
        r = asyncio.run(_one_setting(args, setting))
        print(
            f"| {r['setting']} | {r['stream_max_gap_s']:.2f} s | {r['stream_median_gap_s'] * 1e3:.1f} ms "
            f"| {r['prompt_ttft_s']:.2f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
