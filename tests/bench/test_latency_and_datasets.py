"""`weft bench latency` and `throughput --random-*` end to end on tiny shapes, and
the random / ShareGPT datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench import cli
from benchmarks.bench.datasets import default_tokenizer, load_any, load_sharegpt, random_workload

TINY_ENGINE = ["--dtype", "float32", "--num-threads", "1", "--max-num-batched-tokens", "64", "--quiet"]


@pytest.mark.slow
def test_end_to_end_latency(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    argv = [
        "latency",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-size",
        "2",
        "--num-iters",
        "2",
        "--num-iters-warmup",
        "1",
        "--output-json",
        str(out),
        *TINY_ENGINE,
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["input_len"], report["output_len"], report["batch_size"], report["num_iters"]) == (
        8,
        4,
        2,
        2,
    )
    for name in ("ttft_ms", "decode_ms_per_token", "batch_latency_ms"):
        s = report[name]
        assert 0 < s["median"] <= s["p90"] <= s["p99"], name
        assert s["mean"] > 0
    assert report["ttft_ms"]["mean"] < report["batch_latency_ms"]["mean"]


@pytest.mark.slow
def test_end_to_end_throughput_on_random_prompts(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = [
        "throughput",
        "--random-input-len",
        "6",
        "--random-output-len",
        "3",
        "--num-prompts",
        "3",
        "--output-json",
        str(out),
        *TINY_ENGINE,
    ]
    assert cli.main(argv) == 0
    weft = json.loads(out.read_text())["weft"]
    assert (weft["num_requests"], weft["prompt_tokens"], weft["output_tokens"]) == (3, 18, 9)
    assert weft["total_tokens_per_s"] > weft["output_tokens_per_s"] > 0 and weft["requests_per_s"] > 0


def test_random_workload_is_seeded_and_shaped() -> None:
    a = random_workload(5, 2, 3, vocab_size=100, seed=7)
    assert a == random_workload(5, 2, 3, vocab_size=100, seed=7)
    assert a != random_workload(5, 2, 3, vocab_size=100, seed=8)
    assert all(len(r.prompt_token_ids) == 5 and r.max_tokens == 2 for r in a.requests)
    assert all(0 <= t < 100 for r in a.requests for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="at least 1"):
        random_workload(0, 2, 3, vocab_size=100)


def test_sharegpt_first_human_turn_and_gpt_length(tmp_path: Path) -> None:
    tokenizer = default_tokenizer()
    conversations = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "Hello there"},
                {"from": "gpt", "value": "Hi, how can I help you today?"},
                {"from": "human", "value": "ignored"},
            ],
        },
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn first"}]},
        {
            "id": "c",
            "conversations": [
                {"from": "system", "value": "x"},
                {"from": "human", "value": "Tell me"},
                {"from": "gpt", "value": "Sure"},
            ],
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    workload = load_any(str(path))
    assert [r.prompt for r in workload.requests] == ["Hello there", "Tell me"]
    first = workload.requests[0]
    assert first.prompt_token_ids == tokenizer.encode("Hello there", add_special_tokens=False)
    assert first.max_tokens == len(
        tokenizer.encode("Hi, how can I help you today?", add_special_tokens=False)
    )
    assert workload.ignore_eos
    assert len(load_sharegpt(path, tokenizer, num_prompts=1).requests) == 1
    path.write_text(json.dumps(conversations[1:2]))
    with pytest.raises(ValueError, match="no conversation"):
        load_any(str(path))
