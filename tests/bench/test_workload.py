"""Workload files: the committed ones load, bad ones are refused with a reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.workload import load_workload, resolve_dataset


@pytest.fixture
def smoke8(workloads_dir: Path) -> dict[str, Any]:
    return json.loads((workloads_dir / "smoke-8.json").read_text())


def test_smoke8_loads(workloads_dir: Path) -> None:
    workload = load_workload(workloads_dir / "smoke-8.json")
    assert workload.name == "smoke-8"
    assert workload.ignore_eos
    assert len(workload.requests) == 8
    assert workload.num_prompt_tokens == 359
    assert workload.num_output_tokens == 63
    first = workload.requests[0]
    assert len(first.prompt_token_ids) == 47 and first.max_tokens == 8


@pytest.mark.parametrize("name", ["offline-64", "shared-prefix-96", "pd-mixed", "repetitive-8"])
def test_committed_workloads_load(name: str, workloads_dir: Path) -> None:
    workload = load_workload(workloads_dir / f"{name}.json")
    assert workload.num_prompt_tokens == workload.total_prompt_tokens
    assert workload.num_output_tokens == workload.total_output_tokens


def test_a_bare_name_resolves_in_the_repository_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEFT_WORKLOADS_DIR", raising=False)
    path = resolve_dataset("offline-64")
    assert path == Path(__file__).resolve().parents[2] / "benchmarks" / "workloads" / "offline-64.json"
    assert load_workload(path).name == "offline-64"


def test_head_keeps_the_first_requests_and_their_totals(workloads_dir: Path) -> None:
    workload = load_workload(workloads_dir / "smoke-8.json").head(2)
    assert [r.max_tokens for r in workload.requests] == [8, 10]
    assert workload.total_prompt_tokens == workload.num_prompt_tokens == 47 + 31
    assert workload.total_output_tokens == workload.num_output_tokens == 18
    with pytest.raises(ValueError, match="num_prompts"):
        workload.head(0)


def test_a_bare_name_resolves_in_the_workloads_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WEFT_WORKLOADS_DIR", str(tmp_path))
    assert resolve_dataset("smoke-8") == tmp_path / "smoke-8.json"
    assert resolve_dataset("some/where.json") == Path("some/where.json")


def _set(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


BAD = [
    (("requests", 0, "max_tokens"), "8", r"Expected `int`, got `str` - at `\$.requests\[0\].max_tokens`"),
    (("requests", 1, "max_tokens"), 0, "request 1: max_tokens must be at least 1"),
    (("requests", 2, "prompt_token_ids"), [], "request 2: prompt_token_ids is empty"),
    (("requests", 3, "prompt_token_ids"), [5, -1], "request 3: prompt_token_ids must be non-negative"),
    (("requests",), [], "has no requests"),
    (("requests", 0, "surprise"), 1, "unknown field `surprise`"),
    (("total_output_tokens",), 64, "total_output_tokens says 64, but the requests hold 63"),
    (("total_prompt_tokens",), 1, "total_prompt_tokens says 1, but the requests hold 359"),
    (("ignore_eos",), False, "ignore_eos false"),
    (("name",), None, r"Expected `str`, got `null` - at `\$.name`"),
]


@pytest.mark.parametrize("path, value, why", BAD, ids=[why[:30] for _, _, why in BAD])
def test_bad_workloads_are_refused(
    tmp_path: Path, smoke8: dict[str, Any], path: tuple[Any, ...], value: Any, why: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_set(smoke8, path, value)))
    with pytest.raises(ValueError, match=why):
        load_workload(bad)


def test_a_workload_without_requests_is_refused(tmp_path: Path, smoke8: dict[str, Any]) -> None:
    del smoke8["requests"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(smoke8))
    with pytest.raises(ValueError, match="missing required field `requests`"):
        load_workload(bad)


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]"])
def test_files_that_are_not_workloads_are_refused(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=f"Workload {bad} is not valid"):
        load_workload(bad)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Cannot read workload"):
        load_workload(tmp_path / "nope.json")
