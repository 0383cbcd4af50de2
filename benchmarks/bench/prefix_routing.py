"""Prefix-aware vs load-only data-parallel routing, in one run.

For each routing mode, a ``weft serve`` with two data-parallel ranks and KV
cache events on is started here, and the ``weft bench serve`` client
(``serve_client.run_benchmark``, the same one ``--base-url`` runs) sends
each workload to it: the multi-turn chat set (``benchmarks.bench.multiturn``)
and a named shared workload (default ``shared-prefix-96``). The prefix
cache hit rate comes from the engines' counters on ``/metrics``.

    python -m benchmarks.bench.prefix_routing --num-prompts 32 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench.datasets import default_tokenizer, load_any
from benchmarks.bench.multiturn import multiturn_workload
from benchmarks.bench.serve_client import ClientConfig, run_benchmark, served_model
from benchmarks.bench.workload import Workload
from benchmarks.stack import Stack
from protocol.zmq_sockets import ipc_address

MODES = ("prefix", "load")


def prefix_cache_counters(base_url: str) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the ranks."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=30).text
    totals = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["vllm:prefix_cache_hits"], totals["vllm:prefix_cache_queries"]


def serve_args(mode: str, extra: list[str]) -> list[str]:
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": ipc_address("kv"),
        "replay_endpoint": ipc_address("kvr"),
    }
    return [
        "--data-parallel-size",
        "2",
        "--kv-events-config",
        json.dumps(events),
        "--dp-routing",
        mode,
        *extra,
    ]


def run_mode(
    mode: str, workloads: list[Workload], args: argparse.Namespace, log_dir: Path
) -> list[dict[str, Any]]:
    stack = Stack(serve_args(mode, args.serve_args), log_dir / mode)
    rows = []
    try:
        stack.wait_healthy()
        config = ClientConfig(
            base_url=stack.url,
            model=served_model(stack.url),
            endpoint="/v1/completions",
            max_concurrency=args.max_concurrency,
            quiet=True,
        )
        for workload in workloads:
            hits0, queries0 = prefix_cache_counters(stack.url)
            report = asyncio.run(run_benchmark(config, workload))
            hits1, queries1 = prefix_cache_counters(stack.url)
            queries = queries1 - queries0
            rows.append(
                {
                    "workload": workload.name,
                    "routing": mode,
                    "hit_rate": (hits1 - hits0) / queries if queries else 0.0,
                    "ttft_p50_ms": report["ttft_ms"]["median"],
                    "ttft_p99_ms": report["ttft_ms"]["p99"],
                    "output_tok_s": report["output_throughput"],
                    "completed": report["completed"],
                    "failed": report["failed"],
                }
            )
    finally:
        stack.stop()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | routing | prefix cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['routing']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['output_tok_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench.prefix_routing", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--dataset", default="shared-prefix-96", help="A named workload beside the multi-turn one."
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="Requests per workload.")
    parser.add_argument("--conversations", type=int, default=8, help="Multi-turn conversations.")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument(
        "--output-len", type=int, default=16, help="Output tokens per request (both workloads)."
    )
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*", help="More `weft serve` arguments (after --).")
    args = parser.parse_args(argv)
    if args.num_prompts < args.conversations or args.conversations < 1:
        parser.error("--num-prompts must be at least --conversations (at least 1).")
    tokenizer = default_tokenizer()
    turns = args.num_prompts // args.conversations
    workloads = [
        multiturn_workload(
            num_conversations=args.conversations,
            num_turns=turns,
            output_len=args.output_len,
            vocab_size=tokenizer.vocab_size,
        ),
        _with_output_len(load_any(args.dataset, num_prompts=args.num_prompts), args.output_len),
    ]
    with tempfile.TemporaryDirectory(prefix="weft-prefix-bench-") as log_dir:
        rows = [row for mode in MODES for row in run_mode(mode, workloads, args, Path(log_dir))]
    print(format_table(rows))
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _with_output_len(workload: Workload, output_len: int) -> Workload:
    import msgspec

    requests = [msgspec.structs.replace(r, max_tokens=output_len) for r in workload.requests]
    return msgspec.structs.replace(
        workload, requests=requests, total_output_tokens=output_len * len(requests)
    )


if __name__ == "__main__":
    sys.exit(main())
