"""`weft bench serve` without --base-url: the real run on two smoke-8 requests (offline
engine, then a `weft serve` it starts, over HTTP), and how engine arguments reach the
server's command line. The client against another server: test_serve_client.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench import cli
from benchmarks.bench.serve import serve_argv
from services.api.server import build_parser as serve_parser
from services.config.engine_args import EngineArgs

pytestmark = pytest.mark.slow


def test_end_to_end_serve_bench_on_smoke8(
    tmp_path: Path, workloads_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    # No --base-url: the bench starts `weft serve` itself and streams through the client.
    argv = [
        "serve",
        "--dataset",
        str(workloads_dir / "smoke-8.json"),
        "--num-prompts",
        "2",
        "--dtype",
        "float32",
        "--max-num-batched-tokens",
        "512",
        "--num-threads",
        "1",
        "--max-concurrency",
        "4",
        "--quiet",
        "--goodput",
        "ttft:600000",
        "--output-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "smoke-8" and report["dtype"] == "float32"
    assert report["weft"]["output_tokens"] == report["serve"]["output_tokens"] == 18  # ignore_eos held
    assert report["serve"]["num_requests"] == 2
    metrics = report["serve_metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["total_input_tokens"]) == (
        2,
        0,
        report["weft"]["prompt_tokens"],
    )
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert 0 < metrics[name]["median"] <= metrics[name]["p90"] <= metrics[name]["p99"], name
    assert metrics["ttft_ms"]["p99"] <= metrics["e2el_ms"]["p99"]
    assert metrics["good_requests"] == 2
    assert report["serve"]["output_tokens_per_s"] > 0 and 0 <= report["serve"]["api_cores"] < 16
    ratio = report["serve"]["output_tokens_per_s"] / report["weft"]["output_tokens_per_s"]
    assert report["serve_over_offline_output_tokens_per_s"] == pytest.approx(ratio)
    assert "serve / offline" in capsys.readouterr().out


def test_serve_argv_round_trips_through_weft_serve_parser() -> None:
    engine_args = EngineArgs(
        dtype="float32",
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        data_parallel_size=4,
        max_num_partial_prefills=4,
    )
    args = serve_parser().parse_args(serve_argv(engine_args, port=1234))
    assert (args.port, args.dtype, args.max_num_batched_tokens) == (1234, "float32", 512)
    assert (args.max_num_partial_prefills, args.max_long_partial_prefills) == (4, 1)
    assert args.enable_prefix_caching is False
    assert args.data_parallel_size == 1  # the bench compares one rank with the offline engine


def test_bad_concurrency_is_refused() -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--dataset", "smoke-8", "--max-concurrency", "0"])
