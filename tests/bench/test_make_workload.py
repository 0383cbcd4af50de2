"""Every committed workload rebuilds, byte for byte, from its generator."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench import cli, make_random_workload
from services.api.tokenizer import Tokenizer


@pytest.mark.parametrize(
    "name", ["pd-mixed", "repetitive-8", "smoke-8", "offline-64", "shared-prefix-96", "short-16", "long-2048"]
)
def test_make_workload_rebuilds_the_committed_file(name: str, tmp_path: Path, workloads_dir: Path) -> None:
    assert cli.main(["make-workload", name, "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / f"{name}.json").read_bytes() == (workloads_dir / f"{name}.json").read_bytes()


def test_make_workload_refuses_an_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["make-workload", "offline-65"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'offline-65'" in capsys.readouterr().err


def test_a_random_word_prompt_tokenizes_to_its_ids(default_model) -> None:
    tokenizer = Tokenizer(default_model.hf_dir)
    built = (
        make_random_workload.build_short(tokenizer)["requests"]
        + make_random_workload.build_long(tokenizer)["requests"]
    )
    for request in built:
        assert tokenizer.encode(request["prompt"], add_special_tokens=False) == request["prompt_token_ids"]
