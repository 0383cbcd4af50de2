"""`weft bench executor`: a short real run (model-free workers), and its argument checks."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench import cli
from benchmarks.bench.executor_overhead import decode_step, format_executor_bench, run_executor_bench

pytestmark = pytest.mark.slow


def test_decode_steps_look_like_the_schedulers():
    step = decode_step(32, 0)
    assert step.total_num_scheduled_tokens == 32 and set(step.num_scheduled_tokens.values()) == {1}
    assert step.scheduled_cached_reqs.req_ids == list(step.num_scheduled_tokens)
    assert sum(map(len, step.scheduled_cached_reqs.new_block_ids)) == 2  # one request in 16 starts a block


def test_both_executors_are_timed_for_each_request_count():
    report = run_executor_bench(2, [1, 16], num_steps=20, num_warmup=2)
    rows = report["rows"]
    assert [(r["executor"], r["num_requests"]) for r in rows] == [
        ("uniproc", 1),
        ("multiproc (TP=2)", 1),
        ("uniproc", 16),
        ("multiproc (TP=2)", 16),
    ]
    assert rows[2]["message_bytes"] > rows[0]["message_bytes"]
    assert all(0 < r["p50_us"] <= r["p99_us"] for r in rows)
    table = format_executor_bench(report)
    assert "multiproc (TP=2)" in table and len(table.splitlines()) == 2 + len(rows)


def test_cli_writes_json_and_refuses_one_rank(tmp_path, capsys):
    out = tmp_path / "executor.json"
    argv = [
        "executor",
        "--tensor-parallel-size",
        "2",
        "--num-requests",
        "4",
        "--num-steps",
        "5",
        "--num-warmup",
        "0",
        "--output-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    assert json.loads(out.read_text())["tensor_parallel_size"] == 2
    assert "call bytes" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["executor", "--tensor-parallel-size", "1"])
