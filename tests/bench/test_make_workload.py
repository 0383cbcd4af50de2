"""The generated workloads rebuild, byte for byte, as they are committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench import cli


@pytest.mark.parametrize("name", ["pd-mixed", "repetitive-8"])
def test_make_workload_rebuilds_the_committed_file(name: str, tmp_path: Path, workloads_dir: Path) -> None:
    assert cli.main(["make-workload", name, "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / f"{name}.json").read_bytes() == (workloads_dir / f"{name}.json").read_bytes()


def test_make_workload_refuses_an_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["make-workload", "offline-64"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'offline-64'" in capsys.readouterr().err
