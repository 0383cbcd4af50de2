"""``weft bench latency``: one fixed-shape batch at a time, timed step by step.

Each iteration adds ``batch_size`` random-token prompts of ``input_len`` and
steps the engine until all of them have ``output_len`` tokens. TTFT is the
time until every request of the batch has its first token (the batch's
prefill, over several steps if the token budget splits it); the decode time
per token is the rest divided by ``output_len - 1``.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.bench.datasets import random_workload
from benchmarks.bench.metrics import describe_ms


def run_latency(
    input_len: int,
    output_len: int,
    batch_size: int,
    num_iters: int,
    num_iters_warmup: int,
    quiet: bool = False,
    **engine_args: Any,
) -> dict[str, Any]:
    from tqdm import tqdm

    from services import LLM

    if num_iters < 1 or num_iters_warmup < 0:
        raise ValueError("--num-iters must be at least 1 and --num-iters-warmup at least 0.")
    llm = LLM(**engine_args)
    ttfts: list[float] = []
    decodes: list[float] = []
    totals: list[float] = []
    try:
        workload = random_workload(
            input_len, output_len, batch_size, llm.config.model.vocab_size, seed=engine_args.get("seed") or 0
        )
        prompts = [r.prompt_token_ids for r in workload.requests]
        for _ in tqdm(range(num_iters_warmup), disable=quiet, desc="warm-up"):
            _one_batch(llm, prompts, output_len)
        for _ in tqdm(range(num_iters), disable=quiet, desc="iterations"):
            ttft, decode, total = _one_batch(llm, prompts, output_len)
            ttfts.append(ttft)
            totals.append(total)
            if decode is not None:
                decodes.append(decode)
    finally:
        llm.shutdown()
    return {
        "input_len": input_len,
        "output_len": output_len,
        "batch_size": batch_size,
        "num_iters": num_iters,
        "dtype": llm.config.model.dtype,
        "ttft_ms": describe_ms(ttfts),
        "decode_ms_per_token": describe_ms(decodes),
        "batch_latency_ms": describe_ms(totals),
    }


def add_greedy_batch(llm: Any, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, int]:
    """Add ``prompts`` to the engine as greedy requests of exactly ``output_len`` tokens;
    returns a zeroed token count per request id (for the caller's step loop)."""
    from protocol.engine import EngineCoreRequest
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    counts: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        request_id = f"{tag}-{time.monotonic_ns()}-{i}"
        counts[request_id] = 0
        llm.engine.add_request(
            EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling_params=params,
                arrival_time=time.time(),
            )
        )
    return counts


def _one_batch(llm: Any, prompts: list[list[int]], output_len: int) -> tuple[float, float | None, float]:
    """(seconds to the batch's last first token, decode seconds per token or
    None for one-token outputs, seconds for the whole batch)."""
    start = time.perf_counter()
    counts = add_greedy_batch(llm, prompts, output_len, "latency")
    first_done = None
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step().outputs:
            counts[output.request_id] += len(output.new_token_ids)
        if first_done is None and all(counts.values()):
            first_done = time.perf_counter()
    end = time.perf_counter()
    assert first_done is not None and all(n == output_len for n in counts.values()), "ignore_eos holds"
    ttft = first_done - start
    decode = (end - first_done) / (output_len - 1) if output_len > 1 else None
    return ttft, decode, end - start
